"""Launch-bound or GPU-bound: how much of a region's GPU time its kernels keep the GPU busy.

**What region time means.** A region's time (``gpuscope_region_gpu_seconds``) is the GPU timeline
between its two event records: everything the stream did between them, *including the time it sat
idle waiting for the CPU to launch the next kernel*. A tiny kernel timed back to back reads several
times longer per region with an idle queue than with a full one (docs/design.md, "What region time
means, and the kernel busy ratio"). So a region can be long because its kernels are slow (GPU-bound:
faster kernels help) or because the CPU feeds them slowly (launch-bound: CUDA graphs, fewer and
larger kernels, or a faster host help). Region time alone cannot say which.

**The busy ratio** says it: the kernels' own execution time inside the region, from CUPTI's
activity records, over the region's usual time (the mean of its ordinary samples since the last
window: tracing itself slows launches, so the traced pass's own region time would read long):
``gpuscope_region_gpu_busy_ratio{op,device}``. Near 1: the GPU was busy with this op's kernels;
well under 1: it mostly waited for launches.

**How it is measured: a sampled window.** Tracing every kernel with CUPTI costs CPU time on every
launch, so it is switched on only for one forward pass at a time (``instrument()`` passes: the
per-module regions), at most once per ``min_interval_s`` and no more often than its measured cost
allows within ``budget_share`` of the timer's overhead budget. During such a pass each module's
forward runs under a CUPTI external correlation id (its index), so every kernel it launches is
attributed to it (CUPTI links the two through the launch's runtime or driver API record, so API
activity is traced too during the window); the module's region is timed with events as usual,
with a callback that hands the region's seconds to the window. When the resolver has seen every
region of the pass complete, the window stops tracing, flushes CUPTI's buffers and divides.
Kernels on other streams launched inside a module count too, so the ratio is capped at 1.

CUPTI admits one activity client per process: do not run the window together with
``torch.profiler`` (or Nsight Systems) in the same process.

Off by default: ``timer.enable_kernel_busy()`` (needs the ``cupti-python`` package, the
``gpuscope[cupti]`` extra), or ``gpuscope serve --timing.kernel-busy``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from gpuscope.timing.graph_kernels import GraphNodeLabels

log = logging.getLogger("gpuscope.timing")

#: The window's share of the timer's overhead budget (the rest is for the regions themselves).
DEFAULT_BUDGET_SHARE = 0.25
#: Never more often than this, whatever the budget allows: one pass is a sample of seconds.
DEFAULT_MIN_INTERVAL_S = 10.0
#: A window whose regions have not all completed by then is given up (counted as ``timeout``).
WINDOW_TIMEOUT_S = 5.0
#: Budget assumed when the timer has none (a fixed sampling rate).
FALLBACK_BUDGET = 0.01
OUTCOMES = ("ok", "timeout", "failed")
#: CUDA's CU_GRAPH_NODE_TYPE_KERNEL: the node type whose replays are kernels
CU_GRAPH_NODE_TYPE_KERNEL = 0


class KernelTrace(Protocol):
    """What the window needs from a kernel tracer (CUPTI in production, a fake in tests)."""

    def start(self) -> None:
        """Begin recording kernels and external correlation ids."""
        ...

    def push(self, external_id: int) -> None:
        """Kernels this thread launches from now on belong to ``external_id``."""
        ...

    def pop(self) -> None: ...

    def stop_launches(self) -> None:
        """The traced pass has launched everything: stop what costs per launch (API records)."""
        ...

    def stop(self) -> dict[int, int]:
        """Stop recording; return the kernel nanoseconds recorded per external id."""
        ...


class GraphKernelTrace(KernelTrace, Protocol):
    """A tracer that also sees CUDA graph nodes made and replayed (graph_kernels.py)."""

    def watch_graph_nodes(self, labels: GraphNodeLabels) -> None:
        """From now on, tell ``labels`` of every graph node created or cloned."""
        ...

    def unwatch_graph_nodes(self) -> None:
        """Stop telling (the timer closed): CUPTI's one callback subscriber is free again."""
        ...

    def start_kernels(self) -> None:
        """Begin recording kernels only (a replayed graph's kernels need no API records)."""
        ...

    def stop_graph(self) -> list[tuple[int, int]]:
        """Stop recording; return (graph node id, duration ns) of each graph kernel recorded."""
        ...


def kernel_ns_by_external_id(records: Iterable[Any], kernel_kind: int,
                             correlation_kind: int) -> dict[int, int]:
    """Sum kernel durations per external id from CUPTI activity records (any order).

    Kernel records (``kind == kernel_kind``) carry ``correlation_id``, ``start`` and ``end`` (ns);
    external correlation records (``kind == correlation_kind``) map a launch's ``correlation_id``
    to our ``external_id``. Kernels with no external id (launched outside a window's modules)
    are ignored."""
    owner: dict[int, int] = {}
    kernels: list[tuple[int, int]] = []
    for record in records:
        kind = record.kind
        if kind == correlation_kind:
            owner[record.correlation_id] = record.external_id
        elif kind == kernel_kind:
            kernels.append((record.correlation_id, record.end - record.start))
    busy: dict[int, int] = {}
    for correlation_id, ns in kernels:
        external_id = owner.get(correlation_id)
        if external_id is not None:
            busy[external_id] = busy.get(external_id, 0) + max(0, ns)
    return busy


class CuptiTrace:
    """Kernel activity and external correlation ids through NVIDIA's ``cupti-python``."""

    BUFFER_BYTES = 8 << 20

    def __init__(self) -> None:
        try:
            from cupti import cupti
        except ImportError as exc:
            raise RuntimeError("kernel busy ratios need CUPTI's Python package: "
                               "pip install 'gpuscope[cupti]' (cupti-python)") from exc
        self._cupti = cupti
        self._subscriber: Any = None  # CUPTI's callback subscriber while graph nodes are watched
        kinds = cupti.ActivityKind
        kernel, correlation = kinds.CONCURRENT_KERNEL, kinds.EXTERNAL_CORRELATION
        self._kept = (int(kernel), int(correlation))
        # CUPTI emits external correlation records only beside API records: runtime for torch's
        # launches, driver for libraries that launch through it. Their records are dropped on arrival.
        self._kinds = (kernel, correlation, kinds.RUNTIME, kinds.DRIVER)
        self._correlation = cupti.ExternalCorrelationKind.CUSTOM0
        self._records: list[Any] = []
        self._lock = threading.Lock()
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        # CUPTI sets itself up on first use (hundreds of ms): pay that here, not in the first window,
        # whose cost would otherwise push the next one far out.
        self.start()
        self.stop()

    def reclaim(self) -> None:
        """Register this tracer's buffer callbacks again: another CUPTI client (torch.profiler's
        Kineto, during a profile capture) replaced them, and may have torn CUPTI down."""
        self._cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)

    def _buffer_requested(self) -> tuple[int, int]:
        return self.BUFFER_BYTES, 0

    def _buffer_completed(self, activities: list) -> None:
        kept = self._kept
        mine = [record for record in activities if record.kind in kept]
        with self._lock:
            self._records.extend(mine)

    def start(self) -> None:
        with self._lock:
            self._records.clear()
        for kind in self._kinds:
            self._cupti.activity_enable(kind)

    def push(self, external_id: int) -> None:
        self._cupti.activity_push_external_correlation_id(self._correlation, external_id)

    def pop(self) -> None:
        self._cupti.activity_pop_external_correlation_id(self._correlation)

    def stop_launches(self) -> None:
        for kind in self._kinds[1:]:
            self._cupti.activity_disable(kind)

    def stop(self) -> dict[int, int]:
        return kernel_ns_by_external_id(self._stop_all(), *self._kept)

    def _stop_all(self) -> list[Any]:
        for kind in self._kinds:
            self._cupti.activity_disable(kind)
        self._cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        with self._lock:
            records, self._records = self._records, []
        return records

    # --- CUDA graphs (graph_kernels.py) -----------------------------------------------------

    def watch_graph_nodes(self, labels: GraphNodeLabels) -> None:
        """Subscribe to CUPTI's graph-node callbacks (made during capture, cloned at instantiation).
        CUPTI admits one callback subscriber per process: with another (a profiler), this raises."""
        cupti = self._cupti
        resource = cupti.CallbackIdResource
        self._node_callbacks = (int(resource.GRAPHNODE_CREATED), int(resource.GRAPHNODE_CLONED))
        self._labels = labels
        self._subscriber = cupti.subscribe(self._on_resource, None)
        for cbid in self._node_callbacks:
            cupti.enable_callback(1, self._subscriber, cupti.CallbackDomain.RESOURCE, cbid)

    def unwatch_graph_nodes(self) -> None:
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            self._cupti.unsubscribe(subscriber)

    def _on_resource(self, userdata: Any, domain: Any, cbid: int, data: Any) -> None:
        """CUPTI's resource callback (on the thread that made the node): label it. Never raises into
        CUDA: a failure is counted in the labels' ``callback_errors``."""
        try:
            created, cloned = self._node_callbacks
            cupti = self._cupti
            resource = data if hasattr(data, "resource_descriptor") else cupti.ResourceData.from_ptr(data)
            graph = cupti.GraphData.from_ptr(resource.resource_descriptor)
            node_id = cupti.get_graph_node_id(graph.node)
            if cbid == created:
                self._labels.created(node_id, int(graph.node_type) == CU_GRAPH_NODE_TYPE_KERNEL)
            elif cbid == cloned:
                self._labels.cloned(node_id, cupti.get_graph_node_id(graph.original_node))
        except Exception:
            self._labels.callback_errors += 1

    def start_kernels(self) -> None:
        with self._lock:
            self._records.clear()
        self._cupti.activity_enable(self._kinds[0])

    def stop_graph(self) -> list[tuple[int, int]]:
        kernel = self._kept[0]
        return [(record.graph_node_id, record.end - record.start) for record in self._stop_all()
                if record.kind == kernel and getattr(record, "graph_node_id", 0)]


class _Window:
    """One traced pass: what it expects and what has arrived (guarded by the owner's lock)."""

    def __init__(self, ops: list[Any], device: int, label: str, opened: float) -> None:
        self.ops = ops
        self.device = device
        self.label = label
        self.opened = opened
        self.region_s = [0.0] * len(ops)
        self.expected = 0  # regions whose start was recorded
        self.arrived = 0
        self.pass_done = False
        self.pass_cost_s = 0.0


class _GraphWindow:
    """One traced replay of a compiled model's timed CUDA graph (graph_kernels.py)."""

    def __init__(self, ops_by_region: dict[int, Any], replay: Any, device: int, label: str,
                 opened: float) -> None:
        self.ops_by_region = ops_by_region  # region id → the op it is reported as
        self.replay = replay  # its ``busy`` flag drops once the resolver has read the replay's events
        self.device = device
        self.label = label
        self.opened = opened
        self.pass_done = False
        self.pass_cost_s = 0.0


class KernelBusy:
    """The sampled CUPTI window of one timer (module docstring)."""

    def __init__(self, core: Any, trace: KernelTrace, *, min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
                 budget_share: float = DEFAULT_BUDGET_SHARE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min_interval_s < 0 or not 0 < budget_share <= 1:
            raise ValueError("min_interval_s must be >= 0 and budget_share in (0, 1]")
        self.core = core
        self.trace = trace
        self.min_interval_s = min_interval_s
        self.budget_share = budget_share
        self.clock = clock
        #: the latest ratio per (op, device label)
        self.ratios: dict[tuple[str, str], float] = {}
        #: the latest kernel seconds per pass per (op, device label)
        self.kernel_seconds: dict[tuple[str, str], float] = {}
        self.windows = dict.fromkeys(OUTCOMES, 0)
        self.cost_s = 0.0  # CPU seconds spent on windows so far (traced passes' extra + finishing)
        self.interval_s = min_interval_s
        self._next_at = clock()  # the first sampled pass opens a window
        self._window: _Window | _GraphWindow | None = None
        self._lock = threading.Lock()
        #: each op's histogram (sum, count) at the last window
        self._seen: dict[tuple[str, int], tuple[float, int]] = {}
        #: labels of compiled models' CUDA graph nodes, where the tracer sees graph nodes
        self.labels: GraphNodeLabels | None = None
        watch = getattr(trace, "watch_graph_nodes", None)
        if watch is not None:
            labels = GraphNodeLabels()
            try:
                watch(labels)
                self.labels = labels
            except Exception as exc:  # e.g. a profiler holds CUPTI's one callback subscriber
                log.warning("gpuscope: kernel time in compiled models' CUDA graphs is off: %r", exc)

    def close(self) -> None:
        """The timer closed: end an open window and give CUPTI's callback subscriber back, so that a
        later timer in this process (or a profiler) can take it. Never raises."""
        self._give_up("failed")
        self._next_at = float("inf")  # no window after the timer closed
        if self.labels is not None:
            self.labels = None
            try:
                self.trace.unwatch_graph_nodes()
            except Exception as exc:
                log.warning("gpuscope: CUPTI's graph-node callbacks could not be released: %r", exc)

    @property
    def tracing(self) -> bool:
        """Whether a window is open (CUPTI is this window's until it closes)."""
        return self._window is not None

    def due(self) -> bool:
        """Whether the next sampled pass should be traced (cheap: called once per sampled pass)."""
        return self._window is None and self.clock() >= self._next_at

    def expire(self) -> None:
        """Finish a graph window whose replay the resolver has read, and give up a window whose
        regions have not all completed within ``WINDOW_TIMEOUT_S`` (counted as ``timeout``). The
        resolver thread calls this on each wake-up, after reading what completed, so stopping the
        trace (a flush of CUPTI's buffers) never runs on the inference thread."""
        window = self._window
        if window is None:
            return
        if isinstance(window, _GraphWindow) and window.pass_done and not window.replay.busy:
            self._finish_graph(window)
        elif self.clock() - window.opened > WINDOW_TIMEOUT_S:
            self._give_up("timeout")

    # --- a traced replay of a compiled model's CUDA graph (inference thread) -----------------

    def open_graph(self, ops_by_region: dict[int, Any], replay: Any) -> _GraphWindow | None:
        """Start recording kernels for one replay of a timed graph whose nodes are labelled
        (``self.labels``); None if tracing could not start (counted)."""
        device = self.core.current_device()
        window = _GraphWindow(ops_by_region, replay, device, self.core.device_label(device), self.clock())
        try:
            self.trace.start_kernels()
        except Exception as exc:
            self._failed(exc)
            return None
        self._window = window
        return window

    def close_graph_pass(self, window: _GraphWindow, extra_cpu_s: float) -> None:
        """The traced call returned. Its replay is read by the resolver (``replay.busy`` set until
        then); a replay with nothing queued to read (no fence) cannot say when it completed."""
        window.pass_cost_s = max(0.0, extra_cpu_s)
        if not window.replay.busy:
            self._give_up("failed")
            return
        window.pass_done = True

    def _stop(self, window: Any, stop: Callable[[], Any]) -> tuple[Any, float] | None:
        """End ``window`` if it is still the open one: what ``stop`` (the trace's stop) returns and
        the thread CPU clock before it; None if the window was given up meanwhile or stop failed
        (counted)."""
        with self._lock:
            if self._window is not window:
                return None
            self._window = None
        t0 = time.thread_time()
        try:
            return stop(), t0
        except Exception as exc:
            self._failed(exc)
            return None

    def _finish_graph(self, window: _GraphWindow) -> None:
        stopped = self._stop(window, self.trace.stop_graph)
        if stopped is None:
            return
        kernels, t0 = stopped
        labels = self.labels
        ns_by_op, replays = labels.kernel_ns(kernels, window.ops_by_region.get) if labels else ({}, 0)
        if not replays:  # no labelled kernel replayed: the graph was captured before the labels
            self.windows["failed"] += 1
            self._schedule(window.pass_cost_s + time.thread_time() - t0)
            return
        for op, ns in ns_by_op.items():
            seconds = ns * 1e-9
            self.kernel_seconds[(op.name, window.label)] = seconds
            region_s = self._mean_region_s(op, window.device)
            if region_s > 0:
                self.ratios[(op.name, window.label)] = min(1.0, seconds / region_s)
        self.windows["ok"] += 1
        self._schedule(window.pass_cost_s + time.thread_time() - t0)

    def _mean_region_s(self, op: Any, device: int) -> float:
        """The op's mean region time since the last window, the traced replay's included; 0 if none."""
        hist = op.hists.get(device)
        if hist is None:
            return 0.0
        key = (op.name, device)
        last_sum, last_count = self._seen.get(key, (0.0, 0))
        self._seen[key] = (hist.sum, hist.count)
        count = hist.count - last_count
        return (hist.sum - last_sum) / count if count > 0 else 0.0

    # --- the traced pass (inference thread) ---------------------------------------------------

    def open(self, ops: list[Any], originals: list[Callable]) -> list[Callable] | None:
        """Start tracing a pass over ``ops`` (OpStates, in wrapper order); the forwards to install
        in place of ``originals`` for this pass, or None if tracing could not start (counted)."""
        device = self.core.current_device()
        window = _Window(ops, device, self.core.device_label(device), self.clock())
        try:
            self.trace.start()
        except Exception as exc:
            self._failed(exc)
            return None
        self._window = window
        return [self._wrap(window, index, op, original)
                for index, (op, original) in enumerate(zip(ops, originals, strict=True))]

    def _wrap(self, window: _Window, index: int, op: Any, original: Callable) -> Callable:
        """``original`` timed as an exact region under external id ``index``, for one traced pass."""
        core, trace = self.core, self.trace
        record_start, end = core.record_start, core.end

        def arrived(seconds: float) -> None:
            self._arrived(window, index, seconds)

        def forward(*args: Any, **kwargs: Any) -> Any:
            op.entered += 1
            trace.push(index)
            token = record_start()
            if token is not None:
                window.expected += 1
            try:
                return original(*args, **kwargs)
            finally:
                if token is not None:
                    end(op, token, arrived)
                trace.pop()

        return forward

    def close_pass(self, extra_cpu_s: float) -> None:
        """The traced pass returned; ``extra_cpu_s``: its CPU time beyond an ordinary sampled pass.
        API tracing stops now (it slows every launch); kernel records are collected until the
        resolver has the pass's regions."""
        try:
            self.trace.stop_launches()
        except Exception as exc:
            self._give_up("failed")
            log.warning("gpuscope: kernel busy window failed (counted): %r", exc)
            return
        with self._lock:
            window = self._window
            if window is None:
                return
            window.pass_done = True
            window.pass_cost_s = max(0.0, extra_cpu_s)
            ready = window.arrived >= window.expected
        if ready:
            self._finish(window)

    # --- completion (resolver thread) ---------------------------------------------------------

    def _arrived(self, window: _Window, index: int, seconds: float) -> None:
        with self._lock:
            if self._window is not window:  # given up meanwhile
                return
            window.region_s[index] += seconds
            window.arrived += 1
            ready = window.pass_done and window.arrived >= window.expected
        if ready:
            self._finish(window)

    def _finish(self, window: _Window) -> None:
        stopped = self._stop(window, self.trace.stop)
        if stopped is None:
            return
        busy_ns, t0 = stopped
        for index, op in enumerate(window.ops):
            kernel_s = busy_ns.get(index, 0) * 1e-9
            self.kernel_seconds[(op.name, window.label)] = kernel_s
            region_s = self._typical_region_s(op, window, index)
            if region_s > 0:
                self.ratios[(op.name, window.label)] = min(1.0, kernel_s / region_s)
        self.windows["ok"] += 1
        self._schedule(window.pass_cost_s + time.thread_time() - t0)

    def _typical_region_s(self, op: Any, window: _Window, index: int) -> float:
        """The op's mean region time over its ordinary samples since the last window, or the traced
        pass's own when there are none. Tracing slows every launch (CUPTI records each API call), so
        the traced pass's regions wait longer for launches than untraced ones do; its kernels run
        as fast as ever. Called on the resolver thread, which also fills the histograms."""
        traced = window.region_s[index]
        hist = op.hists.get(window.device)
        if hist is None:
            return traced
        key = (op.name, window.device)
        last_sum, last_count = self._seen.get(key, (0.0, 0))
        self._seen[key] = (hist.sum, hist.count)
        ordinary = hist.count - last_count - 1  # the traced region is in the histogram too
        if ordinary <= 0:
            return traced
        return max(0.0, (hist.sum - last_sum - traced) / ordinary)

    def _schedule(self, cost_s: float) -> None:
        """Next window after ``min_interval_s``, or later if its cost needs more time to fit."""
        self.cost_s += cost_s
        budget = self.core.budget or FALLBACK_BUDGET
        self.interval_s = max(self.min_interval_s, cost_s / (self.budget_share * budget))
        self._next_at = self.clock() + self.interval_s

    def _give_up(self, outcome: str) -> None:
        with self._lock:
            window, self._window = self._window, None
        if window is None:
            return
        try:
            self.trace.stop()
        except Exception:
            outcome = "failed"
        self.windows[outcome] += 1
        self._schedule(window.pass_cost_s)

    def _failed(self, exc: BaseException) -> None:
        self.windows["failed"] += 1
        self._window = None
        log.warning("gpuscope: kernel busy window failed (counted): %r", exc)
        self._schedule(0.0)
