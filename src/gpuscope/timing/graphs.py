"""Regions inside CUDA graphs: timed on sampled replays, with no CPU work per region per replay.

Servers that replay their decode step from a CUDA graph (vLLM, SGLang, ``torch.compile`` in
"reduce-overhead" mode) run no Python per region on replay, so eager regions see nothing there.
``TimedGraph`` captures the step several times:

- once untimed: regions entered during that capture are left out of the graph;
- ``copies`` times timed: every region becomes two external event-record nodes of the graph
  (``cudaEventRecordWithFlags(..., cudaEventRecordExternal)``), with events owned by that copy,
  so every replay of the copy re-records them on the GPU.

``replay()`` replays the untimed graph, except every ``period``-th replay, which replays a timed copy
that is free and records one ordinary event after it (the fence). The resolver reads the copy's
pairs once the fence has completed, and only then frees the copy: a copy is never replayed again
before its last replay was read, so each sample's start and end come from the same replay, also
when replays are queued back to back and when several graphs (one per batch size) share a timer.
When no copy is free the replay runs untimed and a ``graph_busy`` drop is counted.

Why sampled: every event node adds GPU time to the replay (docs/design.md, "CUDA graphs", gives the
H200's figure), so timing every replay would lengthen every replay by that much. At capture the GPU
time of a timed and an untimed replay are measured, and the period is the smallest that keeps the
difference within the timer's budget (a timer with a fixed ``sample_rate`` uses that instead).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Callable
from typing import Any

from gpuscope.timing.core import GraphToken, OpState, Pending, TimerCore
from gpuscope.timing.routes import on_device

#: Event nodes preallocated per timed copy (two per region; a sequence needs one per region + 1).
DEFAULT_EVENTS_PER_COPY = 512
#: Replays of each kind timed at capture to measure what a timed replay costs.
COST_REPLAYS = 10


class GraphRecorder:
    """The event nodes of one timed copy: made before capture, taken in order while capturing."""

    times_regions = True

    def __init__(self, core: TimerCore, device: int, events: int) -> None:
        self.core = core
        self.device = device
        with on_device(core.route, device):
            self.events = [core.route.create() for _ in range(events)]
        self.used = 0
        self.pairs: list[tuple[OpState, Any, Any]] = []
        self.failed = 0

    def take(self, stream: int) -> Any:
        """The next event, recorded as a node of the graph being captured on ``stream`` (or None)."""
        if self.used == len(self.events):
            self.failed += 1
            return None
        event = self.events[self.used]
        if self.core.route.record_external(event, stream):
            self.core.record_failed()
            self.failed += 1
            return None
        self.used += 1
        return event

    # The two calls TimerCore's hot path makes for a region entered during a timed capture.
    def start(self, device: int, stream: int) -> GraphToken | None:
        event = self.take(stream)
        return None if event is None else GraphToken(event, device, stream, self)

    def end(self, op: OpState, token: GraphToken) -> None:
        event = self.take(token.stream)
        if event is not None:
            self.pairs.append((op, token.event, event))

    def add_pair(self, op: OpState, start: Any, end: Any) -> None:
        """A pair made by a sequence (shared boundaries: ``start`` may end the previous pair)."""
        self.pairs.append((op, start, end))

    def destroy(self) -> None:
        with on_device(self.core.route, self.device):
            for event in self.events:
                self.core.route.destroy(event)


class SkipRegions:
    """The recorder of the untimed capture: regions entered during it are left out, uncounted."""

    times_regions = False

    def start(self, device: int, stream: int) -> None:
        return None

    def end(self, op: OpState, token: GraphToken) -> None:
        pass


class GraphReplay:
    """A timed copy in the ring: read and freed by the resolver once its fence has completed."""

    __slots__ = ("busy", "graph", "output", "owner", "recorder")

    def __init__(self, owner: TimedGraph, recorder: GraphRecorder, graph: Any, output: Any) -> None:
        self.owner = owner
        self.recorder = recorder
        self.graph = graph
        self.output = output
        self.busy = False  # replayed and not read yet

    def read(self, elapsed: Callable[[Any, Any], float], baseline_s: float, trace_id: str | None) -> int:
        """Observe every pair of the last replay and free the copy (resolver thread, after the fence);
        return the samples taken. Regions entered in replays since the last read are counted here.
        ``baseline_s`` (the device's eager baseline) is used when the graph has none of its own."""
        device, taken = self.recorder.device, 0
        if self.owner.baseline_s is not None:
            baseline_s = self.owner.baseline_s
        replays = self.owner.replays
        uncounted = replays - self.owner.counted_replays
        self.owner.counted_replays = replays
        for op, start, end in self.recorder.pairs:
            op.entered += uncounted
            try:
                seconds = elapsed(start, end) - baseline_s
            except Exception:
                self.recorder.core.dropped["error"] += 1
                continue
            if op.observe(device, seconds, trace_id):
                taken += 1
            else:  # refused (NaN)
                self.recorder.core.dropped["error"] += 1
        self.busy = False
        return taken


class TorchGraphs:
    """Captures and replays with ``torch.cuda.CUDAGraph``, all sharing one memory pool."""

    def __init__(self, pool: Any = None) -> None:
        import torch

        self._torch = torch
        self.pool = pool

    def capture(self, step: Callable[[], Any]) -> tuple[Any, Any]:
        torch = self._torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, output

    def replay(self, graph: Any) -> None:
        graph.replay()

    def warm_up(self, step: Callable[[], Any], times: int) -> None:
        """Run ``step`` on a side stream first, as torch asks before a capture."""
        torch = self._torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(times):
                step()
        torch.cuda.current_stream().wait_stream(side)

    def empty_pair_seconds(self, core: TimerCore, times: int = 15) -> float | None:
        """Median elapsed time of two back-to-back event nodes behind queued work, in a graph: the
        baseline subtracted from regions timed in graphs (event nodes cost more than eager records)."""
        torch, route = self._torch, core.route
        start, end = route.create(), route.create()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.cuda._sleep(200_000)
                stream = torch.cuda.current_stream().cuda_stream
                if route.record_external(start, stream) or route.record_external(end, stream):
                    route.clear_error()
                    return None
            samples = []
            for _ in range(times):
                graph.replay()
                torch.cuda.current_stream().synchronize()
                samples.append(route.elapsed_s(start, end))
            return statistics.median(samples)
        finally:
            route.destroy(start)
            route.destroy(end)

    def replay_seconds(self, graph: Any, times: int) -> float:
        """Median GPU seconds of one replay of ``graph``."""
        torch = self._torch
        samples = []
        for _ in range(times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(samples)


class TimedGraph:
    """``step`` captured once untimed and ``copies`` times timed; ``replay()`` returns its output.

    The captures share one memory pool (as a server's graphs for several batch sizes do), so the
    output ``replay()`` returns is valid until the next replay: read or copy it before then (in
    stream order, e.g. ``out.clone()`` or the next kernel that consumes it).

    Args:
        timer: the ``Timer`` whose histograms the regions feed.
        step: what to capture: reads static inputs, returns (or writes) its outputs.
        copies: timed captures; more lets sampled replays keep going while the resolver lags.
        period: time every ``period``-th replay (None: from the measured cost and the budget).
        graphs: the capture backend (default ``TorchGraphs``; tests hand in a fake).
        warm_up: runs of ``step`` on a side stream before the first capture.
        events_per_copy: event nodes preallocated per timed copy.
    """

    def __init__(self, timer: Any, step: Callable[[], Any], *, copies: int = 2, period: int | None = None,
                 graphs: Any = None, warm_up: int = 2,
                 events_per_copy: int = DEFAULT_EVENTS_PER_COPY) -> None:
        core: TimerCore = timer.core
        if core.route.name == "torch":
            raise ValueError("timing regions inside CUDA graphs needs the cudart-ctypes or cuda-bindings "
                             "route (torch's events cannot be recorded as graph nodes here)")
        if copies < 1:
            raise ValueError(f"copies must be at least 1, got {copies}")
        self.core = core
        self.graphs = graphs if graphs is not None else TorchGraphs()
        self.device = core.current_device()
        self._lock = threading.Lock()  # replay() may be called from several threads
        self.replays = 0
        self.counted_replays = 0  # replays whose regions are in the ops' entered counts
        if warm_up:  # runs for real: its regions are timed and counted like any other
            self.graphs.warm_up(step, warm_up)
        entered = {op.name: op.entered for op in core.ops()}
        with core.recording_graph(SkipRegions()):
            self._untimed, self._untimed_output = self.graphs.capture(step)
        self.copies: list[GraphReplay] = []
        for _ in range(copies):
            recorder = GraphRecorder(core, self.device, events_per_copy)
            with core.recording_graph(recorder):
                graph, output = self.graphs.capture(step)
            self.copies.append(GraphReplay(self, recorder, graph, output))
        for op in core.ops():  # capturing ran the step's Python without running it on the GPU
            op.entered = entered.get(op.name, 0)
        recorder = self.copies[0].recorder
        self.regions = len(recorder.pairs)
        self.dropped_at_capture = recorder.failed
        self.timed_replays = 0
        self.cost_ratio: float | None = None
        measure_baseline = getattr(self.graphs, "empty_pair_seconds", None)
        self.baseline_s: float | None = measure_baseline(core) if measure_baseline and self.regions else None
        self.period = period if period is not None else self._choose_period()
        self._countdown = 0

    def _choose_period(self) -> int:
        core = self.core
        if core.fixed_rate:
            return core.period
        if not self.regions or not hasattr(self.graphs, "replay_seconds"):
            return core.period
        plain = self.graphs.replay_seconds(self._untimed, COST_REPLAYS)
        timed = self.graphs.replay_seconds(self.copies[0].graph, COST_REPLAYS)
        self.cost_ratio = max(0.0, timed - plain) / plain if plain > 0 else None
        if self.cost_ratio is None or core.budget <= 0:
            return core.period
        return max(1, math.ceil(self.cost_ratio / core.budget))

    def replay(self) -> Any:
        """Replay the step; every ``period``-th replay is timed when a timed copy is free."""
        with self._lock:
            self.replays += 1
            countdown = self._countdown
            if countdown:
                self._countdown = countdown - 1
                self.graphs.replay(self._untimed)
                return self._untimed_output
            self._countdown = self.period - 1
            copy = next((c for c in self.copies if not c.busy), None)
            if copy is None:
                self.core.dropped["graph_busy"] += 1
                self.graphs.replay(self._untimed)
                return self._untimed_output
            return self._replay_timed(copy)

    def _replay_timed(self, copy: GraphReplay) -> Any:
        core, device = self.core, self.device
        free = core.fence_events(device)
        if free is None:
            self.graphs.replay(self._untimed)
            return self._untimed_output
        fence = free.pop()
        stream = core.current_stream(device)
        self.graphs.replay(copy.graph)
        if core.record_event(fence, stream):
            free.append(fence)
            core.record_failed()
            return copy.output
        copy.busy = True
        self.timed_replays += 1
        core.ring.append(Pending(copy, device, stream, None, fence, core.active_trace_id(), None, False))
        return copy.output

    def close(self) -> None:
        """Destroy the copies' events (after the timer has resolved what it will)."""
        for copy in self.copies:
            copy.recorder.destroy()
        self.copies = []
