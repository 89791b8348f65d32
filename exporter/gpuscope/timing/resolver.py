"""The resolver thread: turns finished event pairs into histogram samples, calibrates the
baseline, and adapts the sampling rate to the overhead budget.

It wakes every ``resolve_interval`` (tens of ms): LIMITS.md measured that a thread
waking every 0.5 ms costs the inference thread up to 18% through the GIL, and one
waking every 50 ms ≤ 1%. It never blocks on the GPU: completion is tested with
non-blocking queries, one per stream per wake-up, since events on one stream
complete in order. Every CUDA call it makes runs with the events' device current
(``routes.on_device``): the resolver thread starts on device 0 and serves all devices.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any

from gpuscope.timing.routes import on_device

if TYPE_CHECKING:
    from gpuscope.timing.timer import Timer

log = logging.getLogger("gpuscope.timing")

ADAPT_EVERY_S = 1.0
MIN_SAMPLING_RATIO = 1 / 4096
CALIBRATION_PAIRS = 15
MAX_CONTEXT_FACTOR = 4.0


class Resolver:
    """Background work of one timer (see module docstring)."""

    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self.baseline_s: dict[int, float] = {}
        self.lag_s = 0.0
        self.overhead_ratio = 0.0
        self.callback_errors = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()
        self._head: Any = None
        self._head_since = 0.0
        self._calibration_streams: dict[int, Any] = {}
        self._pending_devices: list[int] = []
        self._skip_cost_idle_s = 0.0
        self._record_cost_idle_s = 0.0
        self._last_adapt: dict[str, float] = {}
        self._resolved = 0  # samples turned into observations
        self._busy_s = 0.0  # time spent resolving samples (the rest of the resolver's CPU is fixed)
        self._active_s = 0.0  # wall time of resolver intervals in which some region was entered
        self._wakes = 0
        self._active_wakes = 0
        self._next_calibration = 0.0
        self._warned: set[str] = set()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._measure_skip_cost()
        self._thread = threading.Thread(target=self._run, name="gpuscope-timing-resolver", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.flush(timeout)

    def add_device(self, device: int) -> None:
        """Called under the timer's lock when a device's pool is created. The device is calibrated
        before any of its samples is resolved (``drain``), so no sample goes uncorrected."""
        self.baseline_s.setdefault(device, 0.0)
        self._pending_devices.append(device)

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self.drain()
            if not self.timer._ring:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def _run(self) -> None:
        try:
            self.timer.route.relax_capture_mode()
        except Exception as exc:
            self._warn_once("capture-mode", f"gpuscope: could not relax CUDA capture mode: {exc}")
        self._last_adapt = self._counters(time.monotonic())
        self._next_calibration = time.monotonic() + self.timer.calibrate_every
        interval = self.timer.resolve_interval
        last_wake, last_entered = time.monotonic(), self._activity()
        while not self._stop.wait(interval):
            try:
                self.drain()
                now = time.monotonic()
                # The budget is a share of the time the program is busy in timed code: a server idle
                # half the time must not spend its whole budget in the busy half.
                entered = self._activity()
                self._wakes += 1
                if entered != last_entered:
                    self._active_s += now - last_wake
                    self._active_wakes += 1
                last_wake, last_entered = now, entered
                if now - self._last_adapt["now"] >= ADAPT_EVERY_S:
                    self._adapt(now)
                if self.timer.calibrate_every and now >= self._next_calibration:
                    self._next_calibration = now + self.timer.calibrate_every
                    for device in list(self.baseline_s):
                        self._calibrate(device)
            except Exception as exc:  # the resolver must outlive any one failure
                self.timer.dropped["error"] += 1
                self._warn_once(type(exc).__name__, f"gpuscope: resolver error (counted): {exc!r}")

    # --- resolution ---------------------------------------------------------------------------

    def drain(self) -> int:
        """Resolve every finished pair at the head of the ring; return how many were taken."""
        # flush() may drain from a caller's thread while the resolver drains too; the lock (never
        # taken on the hot path) keeps one pair from being observed twice.
        with self._drain_lock:
            while self._pending_devices:
                self._calibrate(self._pending_devices.pop(0))
            return self._drain()

    def _drain(self) -> int:
        timer = self.timer
        ring = timer._ring
        if not ring:
            self.lag_s = 0.0
            return 0
        snapshot = list(ring)  # one C-level copy: atomic under the GIL, appends go to the right
        query, use_device = timer.route.query, timer.route.use_device
        t0 = time.thread_time_ns()  # CPU, not wall: waits for the GIL are not resolution cost
        # Streams are per device, so a stream handle (0 is every device's default stream) names
        # its queue only together with its device.
        last_of_stream: dict[tuple[int, int], Any] = {}
        for item in snapshot:
            if item[0] is not None:
                last_of_stream[(item[1], item[2])] = item[4]
        current = snapshot[0][1]
        restore = use_device(current)
        try:
            stream_done = {}
            for (device, stream), end in last_of_stream.items():
                if device != current:
                    current = device
                    use_device(device)
                stream_done[(device, stream)] = query(end)
            taken = self._resolve(snapshot, stream_done, current)
        finally:
            use_device(restore)
        for _ in range(taken):
            ring.popleft()
        self._busy_s += (time.thread_time_ns() - t0) * 1e-9
        self._update_lag(ring)
        return taken

    def _resolve(self, snapshot: list, stream_done: dict, current: int) -> int:
        """Observe the finished pairs at the head of ``snapshot``; return how many were taken."""
        timer = self.timer
        route, free, baseline = timer.route, timer._free, self.baseline_s
        query, elapsed, use_device = route.query, route.elapsed_s, route.use_device
        taken = 0
        for item in snapshot:
            op, device, stream, start, end, trace_id, callback, keep_end = item
            pool = free.get(device)
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
            if not stream_done[(device, stream)] and not query(end):
                break
            try:
                seconds = elapsed(start, end) - baseline.get(device, 0.0)
            except Exception:  # e.g. an event recorded under graph capture
                timer.dropped["error"] += 1
                seconds = None
            if pool is not None:
                pool.append(start)
                if not keep_end:
                    pool.append(end)
            taken += 1
            if seconds is None:
                continue
            if seconds < 0.0:
                seconds = 0.0
            op.histogram(device).observe(seconds, trace_id)
            self._resolved += 1
            if callback is not None:
                try:
                    callback(seconds)
                except Exception as exc:  # a user's callback must not stop timing
                    self.callback_errors += 1
                    self._warn_once("callback", f"gpuscope: on_elapsed callback failed (counted): {exc!r}")
        return taken

    def _update_lag(self, ring: Any) -> None:
        now = time.monotonic()
        head = ring[0] if ring else None
        if head is None:
            self.lag_s = 0.0
        elif head is not self._head:
            self._head_since = now
            self.lag_s = 0.0
        else:
            self.lag_s = now - self._head_since
        self._head = head

    # --- baseline -------------------------------------------------------------------------------

    def _calibrate(self, device: int) -> None:
        """Median elapsed time of an empty pair recorded behind queued work (a busy stream).

        With an idle GPU an empty pair measures the CPU's submit gap (~11 µs on the H200) rather
        than the GPU's own cost (~1.3 µs), so each pair waits behind a short sleep kernel on a
        private stream of ``device``. The first calibration of a device also measures what a
        record costs on an idle thread (see ``skip_cost_s``).
        """
        timer, route = self.timer, self.timer.route
        try:
            with on_device(route, device):
                start, end = route.create(), route.create()
                try:
                    stream, queue_work = self._calibration_stream(device)
                    if not self._record_cost_idle_s:
                        self._measure_record_cost(start, stream)
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
            timer.dropped["error"] += 1
            route.clear_error()
            self._warn_once("calibration", f"gpuscope: baseline calibration failed on device {device} "
                                           f"(counted): {exc!r}")

    def _calibration_stream(self, device: int) -> tuple[int, Any]:
        """A stream of ``device`` to calibrate on, and what queues work ahead of a pair on it."""
        if not self.timer.route.gpu_queue:
            return self.timer._stream(device), lambda: None
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

    def _measure_skip_cost(self) -> None:
        """CPU cost of an unsampled region on an idle thread (once, at start).

        The in-context cost of a sampled region is measured continuously on the hot path; the
        ratio of that to the idle cost of a record scales the unsampled cost to its in-context
        value (records cost about 3× more inside a forward pass than in a microbenchmark).
        """
        from gpuscope.timing.timer import OpState

        timer = self.timer
        probe = OpState("probe", 1 << 30, True)
        probe.countdown = 1 << 30
        n = 2000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            timer._begin(probe)
        self._skip_cost_idle_s = (time.perf_counter_ns() - t0) * 1e-9 / n

    def _measure_record_cost(self, event: Any, stream: int) -> None:
        """CPU cost of a sampled region's two records on an idle thread (``event``'s device current)."""
        route = self.timer.route
        n = 200
        t0 = time.perf_counter_ns()
        for _ in range(n):
            route.record(event, stream)
        self._record_cost_idle_s = 2 * (time.perf_counter_ns() - t0) * 1e-9 / n
        deadline = time.monotonic() + 1.0
        while not route.query(event) and time.monotonic() < deadline:
            time.sleep(0.0002)

    def skip_cost_s(self) -> float:
        """Estimated in-context cost of an unsampled region: the idle figure scaled by how much dearer
        a sampled region is in context than idle, at most MAX_CONTEXT_FACTOR (LIMITS.md measured ~3×;
        on the host route a "record" is a clock read, and the raw ratio means nothing)."""
        hot = self.timer.hot_path_s
        if hot and self._record_cost_idle_s:
            factor = min(MAX_CONTEXT_FACTOR, max(1.0, hot / self._record_cost_idle_s))
            return self._skip_cost_idle_s * factor
        return self._skip_cost_idle_s

    def _activity(self) -> int:
        """Changes whenever any timed code ran: regions entered and instrumented passes."""
        return sum(op.entered for op in self.timer.ops()) + sum(s.passes for s in self.timer.samplers())

    def _counters(self, now: float) -> dict[str, float]:
        timer = self.timer
        counters = {
            "now": now, "cpu": time.thread_time(), "busy": self._busy_s, "active": self._active_s,
            "wakes": self._wakes, "active_wakes": self._active_wakes, "resolved": self._resolved,
        }
        direct = [op for op in timer.ops() if op.owner is None]
        counters["direct_entered"] = sum(op.entered for op in direct)
        counters["always"] = sum(op.always for op in direct)  # a subset of direct_entered
        for sampler in timer.samplers():
            counters[f"passes:{id(sampler)}"] = sampler.passes
            counters[f"sampled:{id(sampler)}"] = sampler.sampled_passes
        return counters

    def _adapt(self, now: float) -> None:
        """Set the sampling period so the estimated cost stays within budget × busy time.

        cost = sampled direct regions × hot path + unsampled direct regions × skip cost
             + sampled passes × (their measured extra CPU)        [instrument(), per pass]
             + resolved samples × resolution cost + the resolver's wake-ups in busy intervals,
        against the wall time of the resolver intervals in which timed code ran (a server idle
        half the time must not spend its whole budget in the busy half). Regions started with
        ``on_elapsed`` are timed every time: their cost comes off the allowance first, and only the
        rest is shared among the regions sampling can thin (when they alone exceed the budget,
        the rest is sampled at the floor rate and ``overhead_ratio`` shows the excess).
        """
        timer = self.timer
        before, after = self._last_adapt, self._counters(now)
        self._last_adapt = after
        delta = {key: after[key] - before.get(key, 0) for key in after}
        wall = delta["active"]
        if wall <= 0:
            return
        hot = timer.hot_path_s or self._record_cost_idle_s
        skip = self.skip_cost_s()
        per_resolved = delta["busy"] / delta["resolved"] if delta["resolved"] else 0.0
        fixed = max(0.0, delta["cpu"] - delta["busy"]) * (
            delta["active_wakes"] / delta["wakes"] if delta["wakes"] else 1.0)
        pass_spent = pass_full = pass_samples = 0.0
        for sampler in timer.samplers():
            passes, sampled = delta.get(f"passes:{id(sampler)}", 0), delta.get(f"sampled:{id(sampler)}", 0)
            per_region = hot if sampler.mode == "exact" else hot / 2
            # The in-program measurement is noisy (pass-to-pass jitter): never trust it below what
            # the records alone cost in context.
            floor = per_region * sampler.samples_per_pass()
            per_pass = max(sampler.cost.per_sampled_pass_s() or 0.0, floor)
            pass_spent += sampled * per_pass
            pass_full += passes * (per_pass + sampler.samples_per_pass() * per_resolved)
            pass_samples += sampled * sampler.samples_per_pass()
        direct_entered = delta["direct_entered"]
        direct_sampled = max(0.0, delta["resolved"] - pass_samples)
        spent = (direct_sampled * hot + max(0.0, direct_entered - direct_sampled) * skip + pass_spent
                 + delta["busy"] + fixed)
        self.overhead_ratio = spent / wall
        always = delta["always"]
        thinnable = max(0.0, direct_entered - always)
        full = thinnable * (hot + per_resolved) + pass_full
        if timer._fixed_rate or full <= 0:
            return
        allowance = timer.budget * wall - fixed - thinnable * skip - always * (hot + per_resolved)
        ratio = min(1.0, max(MIN_SAMPLING_RATIO, allowance / full))
        target = max(1, round(1 / ratio))
        # Move at most 4× per second so one noisy window cannot swing the rate.
        period = min(max(target, timer._period // 4), max(1, timer._period * 4))
        timer._period = period
        for op in timer.ops():
            if not op.fixed:
                op.period = period
        for sampler in timer.samplers():
            sampler.pass_state.period = period

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
