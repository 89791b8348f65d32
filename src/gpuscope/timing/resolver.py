"""The resolver thread: turns finished event pairs into histogram samples, calibrates each
device's baseline, and asks the budget controller (``budget.py``) to adapt the sampling rate.

It wakes every ``resolve_interval`` (tens of ms): a thread waking every fraction of a millisecond
took a large share of the inference thread's throughput through the GIL, one waking this seldom next
to none (docs/design.md, "Inside a real forward pass"). It never blocks on the GPU: completion is
tested with non-blocking queries, one per stream per wake-up, since events on one stream complete in
order. Every CUDA call it makes runs with the events' device current (``routes.on_device``): the
resolver thread starts on device 0 and serves all devices. Where the C hot path runs a recycler
(``hot.py``), plain pairs were already read by its thread and ``drain`` only collects them into
histograms; otherwise, where the C extension is built, they go through its loop
(``hot.resolve_loop``), which asks CUDA with the GIL released. Graph replays and pairs with a
callback always take the Python loop below.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any

from gpuscope.timing import hot
from gpuscope.timing.budget import BudgetController
from gpuscope.timing.core import Pending, TimerCore
from gpuscope.timing.graphs import GraphReplay
from gpuscope.timing.routes import on_device

log = logging.getLogger("gpuscope.timing")

CALIBRATION_PAIRS = 15


class Resolver:
    """Background work of one timer (see module docstring)."""

    def __init__(self, core: TimerCore, budget: BudgetController, *, resolve_interval: float,
                 calibrate_every: float) -> None:
        self.core = core
        self.budget = budget
        self.resolve_interval = resolve_interval
        self.calibrate_every = calibrate_every
        self.baseline_s: dict[int, float] = {}
        self.lag_s = 0.0
        self.callback_errors = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()
        self._head: Any = None
        self._head_since = 0.0
        self._calibration_streams: dict[int, Any] = {}
        self._pending_devices: list[int] = []
        self._resolved = 0  # samples turned into observations
        self._busy_s = 0.0  # time spent resolving samples (the rest of the resolver's CPU is fixed)
        self._active_s = 0.0  # wall time of resolver intervals in which some region was entered
        self._wakes = 0
        self._active_wakes = 0
        self._next_calibration = 0.0
        self._warned: set[str] = set()
        self._capture_mode_relaxed = False
        #: the C loop for plain pairs (hot.resolve_loop) where the core runs the C hot path without a
        #: recycler (with one, ``ring`` holds no plain pairs)
        self.fast = hot.resolve_loop(core.route, dropped=core.dropped,
                                     pending_type=Pending) if core.native and not core.recycling else None
        core.on_new_device = self.add_device

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self.budget.measure_skip_cost()
        self._thread = threading.Thread(target=self._run, name="gpuscope-timing-resolver", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.flush(timeout)
        if self.core.recycling:  # before the events are destroyed: the thread may still ask about them
            self.core.hot.stop_recycler()

    def add_device(self, device: int) -> None:
        """Called under the core's lock when a device's pool is created. The device is calibrated
        before any of its samples is resolved (``drain``), so no sample goes uncorrected."""
        self.baseline_s.setdefault(device, 0.0)
        self._pending_devices.append(device)

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        core = self.core
        while True:
            if core.recycling:  # what finished is read by the recycler's next pass
                core.hot.recycle_pass(max(0.0, min(0.1, deadline - time.monotonic())))
            self.drain()
            if not core.pending():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def counters(self) -> dict[str, float]:
        """Cumulative figures the budget controller turns into windows."""
        return {"busy": self._busy_s, "resolved": self._resolved, "active": self._active_s,
                "wakes": self._wakes, "active_wakes": self._active_wakes}

    def _run(self) -> None:
        budget = self.budget
        budget.start_window(time.monotonic(), self.counters())
        self._next_calibration = time.monotonic() + self.calibrate_every
        last_wake, last_entered = time.monotonic(), budget.activity()
        while not self._stop.wait(self.resolve_interval):
            try:
                self.drain()
                busy = self.core.busy
                if busy is not None:  # the kernel busy window's timeout is checked here, off the hot path
                    busy.expire()
                now = time.monotonic()
                # The budget is a share of the time the program is busy in timed code: a server idle
                # half the time must not spend its whole budget in the busy half.
                entered = budget.activity()
                self._wakes += 1
                if entered != last_entered:
                    self._active_s += now - last_wake
                    self._active_wakes += 1
                last_wake, last_entered = now, entered
                if budget.due(now):
                    budget.adapt(now, self.counters())
                if self.calibrate_every and now >= self._next_calibration:
                    self._next_calibration = now + self.calibrate_every
                    for device in list(self.baseline_s):
                        self._calibrate(device)
            except Exception as exc:  # the resolver must outlive any one failure
                self.core.dropped["error"] += 1
                self._warn_once(type(exc).__name__, f"gpuscope: resolver error (counted): {exc!r}")

    # --- resolution ---------------------------------------------------------------------------

    def drain(self) -> int:
        """Resolve every finished pair at the head of the ring; return how many were taken."""
        # flush() may drain from a caller's thread while the resolver drains too; the lock (never
        # taken on the hot path) keeps one pair from being observed twice.
        with self._drain_lock:
            while self._pending_devices:
                self._calibrate(self._pending_devices.pop(0))
            taken = self._drain()
            if self.core.recycling:
                t0 = time.thread_time_ns()
                observed = self.core.hot.collect(self.baseline_s)
                self._resolved += observed
                self._busy_s += (time.thread_time_ns() - t0) * 1e-9
                taken += observed
            self._update_lag()
            return taken

    def _drain(self) -> int:
        """Resolve the finished pairs at the head of ``ring``; return how many were taken."""
        core = self.core
        ring = core.ring
        if not ring:
            return 0
        snapshot = list(ring)  # one C-level copy: atomic under the GIL, appends go to the right
        use_device = core.route.use_device
        t0 = time.thread_time_ns()  # CPU, not wall: waits for the GIL are not resolution cost
        current = snapshot[0].device
        restore = use_device(current)
        self._relax_capture_mode()
        try:
            stream_done: dict[tuple[int, int], bool] = {}
            if self.fast is None:  # the C loop asks CUDA about each stream itself, without the GIL
                stream_done, current = self._streams_done(snapshot, current)
            taken = self._resolve(snapshot, stream_done, current)
        finally:
            if core.route.has_context(restore):  # never open a context on a device nobody uses
                use_device(restore)
        for _ in range(taken):
            ring.popleft()
        self._busy_s += (time.thread_time_ns() - t0) * 1e-9
        return taken

    def _streams_done(self, snapshot: list, current: int) -> tuple[dict[tuple[int, int], bool], int]:
        """Whether each stream's last pair in ``snapshot`` has finished (events of one stream finish in
        order, so it answers for the pairs before it), and the device current after asking."""
        # Streams are per device, so a stream handle (0 is every device's default stream) names
        # its queue only together with its device.
        last_of_stream: dict[tuple[int, int], Any] = {}
        for item in snapshot:
            if item.op is not None:
                last_of_stream[(item.device, item.stream)] = item.end
        query, use_device = self.core.route.query, self.core.route.use_device
        done = {}
        for (device, stream), end in last_of_stream.items():
            if device != current:
                current = device
                use_device(device)
            done[(device, stream)] = query(end)
        return done, current

    def _resolve(self, snapshot: list, stream_done: dict, current: int) -> int:
        """Observe the finished pairs at the head of ``snapshot``; return how many were taken."""
        core = self.core
        route, free, baseline = core.route, core.pools, self.baseline_s
        query, elapsed, use_device = route.query, route.elapsed_s, route.use_device
        fast, op_type = self.fast, core.op_type
        taken = 0
        while taken < len(snapshot):
            op, device, stream, start, end, trace_id, callback, keep_end = snapshot[taken]
            pool = free.get(device)
            if fast is not None and pool is not None and (op is None or op.__class__ is op_type):
                if device != current:
                    current = device
                    use_device(device)
                index, resolved, blocked = fast.run(snapshot, taken, device, baseline.get(device, 0.0), pool)
                self._resolved += resolved
                if blocked:
                    return index
                if index > taken:
                    taken = index
                    continue
            # Python: graph replays, pairs with a callback, and every pair without the C loop
            if op is None:  # dropped pair kept only to release its events in order
                if pool is not None:
                    pool.append(start)
                    if end is not None and not keep_end:
                        pool.append(end)
                taken += 1
                continue
            if device != current:
                current = device
                use_device(device)
            if not stream_done.get((device, stream)) and not query(end):
                break
            if op.__class__ is GraphReplay:  # a timed graph replay: ``end`` is the fence after it
                self._resolved += op.read(elapsed, baseline.get(device, 0.0), trace_id)
                if pool is not None:
                    pool.append(end)
                taken += 1
                continue
            try:
                seconds = elapsed(start, end) - baseline.get(device, 0.0)
            except Exception:  # e.g. an event recorded under graph capture
                core.dropped["error"] += 1
                seconds = None
            if pool is not None:
                pool.append(start)
                if not keep_end:
                    pool.append(end)
            taken += 1
            if seconds is None:
                continue
            if op.observe(device, seconds, trace_id):
                self._resolved += 1
            else:  # refused (NaN)
                core.dropped["error"] += 1
            if callback is not None:
                try:
                    callback(0.0 if seconds < 0.0 else seconds)  # as observed
                except Exception as exc:  # a user's callback must not stop timing
                    self.callback_errors += 1
                    self._warn_once("callback", f"gpuscope: on_elapsed callback failed (counted): {exc!r}")
        return taken

    def _update_lag(self) -> None:
        """How long the oldest unobserved pair has stayed so (0 when none waits or the head moved)."""
        now = time.monotonic()
        core = self.core
        ring, queued = core.ring, core.hot.queued
        if not ring and not queued:
            self._head, self.lag_s = None, 0.0
            return
        # The heads of both rings: the Python one by identity, the recycler's by its position.
        head = (ring[0] if ring else None, core.hot.collected if queued else -1)
        if self._head is None or head[0] is not self._head[0] or head[1] != self._head[1]:
            self._head_since = now
            self.lag_s = 0.0
        else:
            self.lag_s = now - self._head_since
        self._head = head

    # --- baseline -------------------------------------------------------------------------------

    def _relax_capture_mode(self) -> None:
        """Exempt the resolver thread from "global" capture mode, once, with a device of the timer current.

        An inference thread may capture a CUDA graph in global mode, which forbids event queries from
        *any* thread and would invalidate the capture; relaxed mode exempts this thread (what
        PyTorch's NCCL watchdog does). Not done when the thread starts: the call initialises the
        runtime on the thread's current device, and a new thread's is device 0, which opened a
        context (hundreds of MiB) on a GPU that a program running on cuda:1 never used.
        """
        if self._capture_mode_relaxed or threading.current_thread() is not self._thread:
            return
        self._capture_mode_relaxed = True
        try:
            self.core.route.relax_capture_mode()
        except Exception as exc:
            self._warn_once("capture-mode", f"gpuscope: could not relax CUDA capture mode: {exc}")

    def _calibrate(self, device: int) -> None:
        """Median elapsed time of an empty pair recorded behind queued work (a busy stream).

        With an idle GPU an empty pair measures the CPU's submit gap, several times the GPU's own
        cost (docs/design.md, "CPU cost of one call"), rather than that cost, so each pair waits
        behind a short sleep kernel on a private stream of ``device``. The first calibration also
        measures what a record costs on an idle thread (the budget controller scales unsampled
        regions' cost with it).
        """
        core, route = self.core, self.core.route
        try:
            with on_device(route, device):
                self._relax_capture_mode()
                start, end = route.create(), route.create()
                try:
                    stream, queue_work = self._calibration_stream(device)
                    if not self.budget.record_cost_idle_s:
                        self.budget.measure_record_cost(start, stream)
                    samples = []
                    for _ in range(CALIBRATION_PAIRS):
                        queue_work()
                        route.use_device(device)  # torch's guards may have moved the runtime's
                        if route.record(start, stream) or route.record(end, stream):
                            route.clear_error()
                            raise RuntimeError(f"cannot record calibration events on device {device}")
                        deadline = time.monotonic() + 1.0
                        while route.gpu_queue and not route.query(end):
                            if time.monotonic() > deadline:
                                raise TimeoutError("calibration pair did not complete within 1 s")
                            time.sleep(0.0002)
                        samples.append(route.elapsed_s(start, end))
                finally:
                    route.destroy(start)
                    route.destroy(end)
            self.baseline_s[device] = statistics.median(samples)
        except Exception as exc:  # keep the last baseline; count and go on
            core.dropped["error"] += 1
            route.clear_error()
            self._warn_once("calibration", f"gpuscope: baseline calibration failed on device {device} "
                                           f"(counted): {exc!r}")

    def _calibration_stream(self, device: int) -> tuple[int, Any]:
        """A stream of ``device`` to calibrate on, and what queues work ahead of a pair on it."""
        if not self.core.route.gpu_queue:
            return self.core.current_stream(device), lambda: None
        import torch

        stream = self._calibration_streams.get(device)
        if stream is None:
            stream = self._calibration_streams[device] = torch.cuda.Stream(device=device)

        def queue_work() -> None:
            # ~0.1 ms of GPU work ahead of the pair, far longer than the CPU needs to queue both
            # records, so the pair is timed back to back on the GPU. The device guard first, so
            # the stream switch does not move this thread's device on its own.
            with torch.cuda.device(device), torch.cuda.stream(stream):
                torch.cuda._sleep(200_000)

        return stream.cuda_stream, queue_work

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
