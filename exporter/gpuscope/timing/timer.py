"""The timer: the hot path that records event pairs, and the objects users hold.

Hot-path rules (BRIEF.md): no blocking, no lock, no I/O, no CUDA allocation. A
sampled region costs two event records, one pop from a preallocated free list
and one append to a bounded ring; an unsampled one costs a counter decrement.
Everything else (waiting for the GPU, elapsed time, baseline subtraction,
histograms, sampling adaptation) happens on the resolver thread.

Counters are plain attributes bumped under the GIL; with several inference
threads an increment can very rarely be lost to a thread switch, which is the
price of taking no lock.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from gpuscope.catalogue import REGION_SECONDS_BUCKETS
from gpuscope.timing import capture
from gpuscope.timing.histogram import BucketHistogram
from gpuscope.timing.routes import Route, on_device, pick_route

log = logging.getLogger("gpuscope.timing")

_trace_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("gpuscope_trace_id", default=None)

DROP_REASONS = ("ring_full", "pool_empty", "graph_capture", "error", "closed")


@contextmanager
def trace(trace_id: str | None) -> Iterator[None]:
    """Make ``trace_id`` the active trace: regions ending inside carry it as their exemplar."""
    token = _trace_id.set(trace_id)
    try:
        yield
    finally:
        _trace_id.reset(token)


def current_trace_id() -> str | None:
    """The active trace id, if any."""
    return _trace_id.get()


class OpState:
    """Per-op sampling state and histograms (one per device), owned by one timer."""

    __slots__ = ("always", "countdown", "entered", "fixed", "hists", "name", "owner", "period")

    def __init__(self, name: str, period: int, fixed: bool) -> None:
        self.name = name
        self.owner: Any = None  # the Instrumentation whose sampled passes count this op, if any
        self.period = period
        self.countdown = 0  # the first region of every op is timed
        self.entered = 0
        self.always = 0  # regions started with on_elapsed: timed every time, outside the budget's reach
        self.fixed = fixed
        self.hists: dict[int, BucketHistogram] = {}

    def histogram(self, device: int) -> BucketHistogram:
        hist = self.hists.get(device)
        if hist is None:
            hist = self.hists[device] = BucketHistogram(REGION_SECONDS_BUCKETS)
        return hist


class Region:
    """``with timer.region("op"):`` or ``@timer.region("op")``; reusable and thread-safe."""

    __slots__ = ("_op", "_timer")

    def __init__(self, timer: Timer, op: OpState) -> None:
        self._timer = timer
        self._op = op

    def __enter__(self) -> Region:
        token = self._timer._begin(self._op)
        local = self._timer._local
        try:
            local.stack.append(token)
        except AttributeError:
            local.stack = [token]
        return self

    def __exit__(self, *exc: object) -> None:
        token = self._timer._local.stack.pop()
        if token is not None:
            self._timer._end(self._op, token, None)

    def __call__(self, fn: Callable) -> Callable:
        begin, end, op = self._timer._begin, self._timer._end, self._op

        def timed(*args: Any, **kwargs: Any) -> Any:
            token = begin(op)
            try:
                return fn(*args, **kwargs)
            finally:
                if token is not None:
                    end(op, token, None)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        timed.__name__ = getattr(fn, "__name__", "timed")
        timed.__doc__ = fn.__doc__
        return timed


class Handle:
    """What ``timer.start`` returns; pass it to ``timer.stop``."""

    __slots__ = ("callback", "op", "token")

    def __init__(self, op: OpState, token: Any, callback: Callable[[float], None] | None) -> None:
        self.op = op
        self.token = token
        self.callback = callback


class Timer:
    """Times GPU work with CUDA events (or wall time on CPU-only machines) into Prometheus histograms.

    Args:
        registry: where the timer's metrics are registered (None: nowhere).
        backend: "auto" (CUDA if available, else host), "cuda", "host", or a route name.
        budget: share of wall time the timer may cost; sampling adapts to stay within it.
            Ignored when ``sample_rate`` is given.
        sample_rate: fixed share of regions to time (1.0 = every region).
        resolve_interval: seconds between resolver wake-ups (tens of ms: a fast-polling
            thread steals the GIL from the inference thread, LIMITS.md).
        pool_size: events preallocated per device.
        ring_size: sampled regions that may wait for the GPU before new ones are dropped.
        calibrate_every: seconds between baseline re-calibrations (0: only at start).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = REGISTRY,
        *,
        backend: str = "auto",
        budget: float = 0.01,
        sample_rate: float | None = None,
        resolve_interval: float = 0.05,
        pool_size: int = 4096,
        ring_size: int = 2048,
        calibrate_every: float = 60.0,
        route: Route | None = None,
    ) -> None:
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if sample_rate is None and not 0 < budget < 1:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        if resolve_interval <= 0 or pool_size < 4 or ring_size < 1:
            raise ValueError("resolve_interval must be > 0, pool_size >= 4 and ring_size >= 1")
        self.route: Route = route or pick_route(backend)
        self.is_host = bool(getattr(self.route, "on_host", False))
        self.budget = 0.0 if sample_rate is not None else budget
        self.pool_size = pool_size
        self.ring_size = ring_size
        self.resolve_interval = resolve_interval
        self.calibrate_every = calibrate_every
        # Budget mode starts cautious and lets the resolver raise the rate within a second.
        self._period = 1 if sample_rate is not None and sample_rate >= 1 else (
            max(1, round(1 / sample_rate)) if sample_rate is not None else 16)
        self._fixed_rate = sample_rate is not None
        self._ops: dict[str, OpState] = {}
        self._samplers: list[Any] = []  # instrumentations, sampled per forward pass
        self._regions: dict[str, Region] = {}
        self._ops_lock = threading.Lock()  # only taken when a new op name first appears
        self._local = threading.local()
        self._ring: deque = deque()
        self._free: dict[int, list[Any]] = {}
        self._all_events: dict[int, list[Any]] = {}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.sampled = 0  # pairs ended through _end: paces the in-context cost measurement
        self.closed = False
        self._warned_capture = False
        self._record = self.route.record
        self._trace_get = _trace_id.get
        self._captures = capture.in_progress
        if self.route.gpu_queue:
            capture.install()
        self._device = self.route.current_device
        self._stream = self.route.current_stream
        # Asked only while some capture is in progress (see capture.py).
        self._capturing = self.route.is_capturing
        # Cost of the hot path, measured in context on a few sampled regions (see _end).
        self.hot_path_s = 0.0
        self._measure_every = 16

        from gpuscope.timing.resolver import Resolver  # resolver imports this module

        # No pool yet: a device's events are made where it is first used. A server picks its
        # device after creating the timer, and making events on whatever device is current here
        # would open a CUDA context (hundreds of MiB) on a GPU the program never uses.
        self._resolver = Resolver(self)
        self._resolver.start()
        if registry is not None:
            from gpuscope.timing.collector import TimerCollector

            registry.register(TimerCollector(self))
        self._registry = registry
        ref = weakref.ref(self)
        atexit.register(lambda: (t := ref()) is not None and t.close(timeout=1.0))

    # --- user API ---------------------------------------------------------------------------

    def region(self, op: str) -> Region:
        """The region object for ``op`` (cached): a context manager and a decorator."""
        region = self._regions.get(op)
        if region is None:
            region = self._regions[op] = Region(self, self.op_state(op))
        return region

    def start(self, op: str, on_elapsed: Callable[[float], None] | None = None) -> Handle:
        """Start timing ``op``; with ``on_elapsed`` the region is always timed and the callback
        gets its GPU seconds on the resolver thread."""
        state = self.op_state(op)
        if on_elapsed is None:
            return Handle(state, self._begin(state), None)
        state.entered += 1
        state.always += 1
        return Handle(state, self._record_start(), on_elapsed)

    def stop(self, handle: Handle) -> None:
        """End the region ``handle`` started (a second stop of the same handle does nothing)."""
        token, handle.token = handle.token, None
        if token is not None:
            self._end(handle.op, token, handle.callback)

    def sequence(self) -> Sequence:
        """Contiguous regions that share boundary events (N+1 records for N regions)."""
        return Sequence(self)

    def instrument(self, model: Any, include: Any = None, *, mode: str = "exact",
                   op_name: Callable[[str], str] | None = None) -> Any:
        """Time chosen submodules of a ``torch.nn.Module``; see ``gpuscope.timing.instrument``."""
        from gpuscope.timing.instrument import instrument

        return instrument(self, model, include, mode=mode, op_name=op_name)

    def set_sample_rate(self, op: str, rate: float) -> None:
        """Fix one op's sampling rate (exempt from budget adaptation)."""
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        state = self.op_state(op)
        state.period = max(1, round(1 / rate))
        state.fixed = True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (polling) until every recorded sample is resolved; True if the ring emptied in time."""
        return self._resolver.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the resolver, resolve what completes within ``timeout``, destroy every event."""
        if self.closed:
            return
        self.closed = True
        self._resolver.stop(timeout)
        for device, events in self._all_events.items():
            self._free[device] = []
            self._destroy(device, events)
        self._all_events.clear()

    def __enter__(self) -> Timer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- state --------------------------------------------------------------------------------

    def op_state(self, op: str) -> OpState:
        state = self._ops.get(op)
        if state is None:
            with self._ops_lock:
                state = self._ops.get(op)
                if state is None:
                    state = self._ops[op] = OpState(op, self._period, self._fixed_rate)
        return state

    def ops(self) -> list[OpState]:
        return list(self._ops.values())

    def samplers(self) -> list[Any]:
        return list(self._samplers)

    def _register_sampler(self, sampler: Any) -> None:
        with self._ops_lock:
            self._samplers.append(sampler)

    def _unregister_sampler(self, sampler: Any) -> None:
        with self._ops_lock:
            if sampler in self._samplers:
                self._samplers.remove(sampler)
            for op in sampler.op_states:
                op.owner = None if op.owner is sampler else op.owner

    def device_label(self, device: int) -> str:
        return "cpu" if self.is_host else str(device)

    def _add_device(self, device: int) -> list[Any]:
        """Preallocate a device's events (once per device; never on the steady-state hot path).

        The events are made with ``device`` current, whatever this thread's current device is
        in the runtime (torch may set it lazily). If that fails, the device keeps an empty pool:
        its regions are dropped as ``pool_empty`` after one counted ``error``, never retried."""
        with self._ops_lock:
            if self.closed:
                return []
            if device not in self._free:
                events: list[Any] = []
                try:
                    with on_device(self.route, device):
                        for _ in range(self.pool_size):
                            events.append(self.route.create())
                except Exception as exc:
                    self.dropped["error"] += 1
                    log.warning("gpuscope: cannot create timing events on device %s; its regions "
                                "are not timed (counted): %r", device, exc)
                    self._destroy(device, events)
                    events = []
                else:
                    self._resolver.add_device(device)
                self._all_events[device] = events
                self._free[device] = list(events)
        return self._free[device]

    def _destroy(self, device: int, events: list[Any]) -> None:
        try:
            with on_device(self.route, device):
                for event in events:
                    self.route.destroy(event)
        except Exception:  # CUDA may already be torn down at exit
            pass

    def _record_failed(self) -> None:
        """Count a failed record and clear CUDA's last-error slot, which torch checks after its next
        kernel launch: our failure must not surface as an exception in the caller's code."""
        self.dropped["error"] += 1
        self.route.clear_error()

    def _note_capture(self) -> None:
        self.dropped["graph_capture"] += 1
        if not self._warned_capture:
            self._warned_capture = True
            log.warning("gpuscope: regions inside CUDA graph capture are not timed (capture left intact)")

    # --- hot path -----------------------------------------------------------------------------

    def _begin(self, op: OpState) -> Any:
        """Count the region; if it is sampled, record its start event and return the token."""
        op.entered += 1
        countdown = op.countdown
        if countdown:
            op.countdown = countdown - 1
            return None
        op.countdown = op.period - 1
        return self._record_start()

    def _record_start(self) -> Any:
        # No "closed" test here: close() empties the pools, so a late region finds none.
        # Sequence.split repeats these few lines rather than call a shared helper: one Python
        # frame more per region costs about as much as a record does in context.
        device = self._device()
        if self._captures[0] and self._capturing():
            self._note_capture()
            return None
        try:
            free = self._free[device]
        except KeyError:
            free = self._add_device(device)
        if not free:
            self.dropped["pool_empty"] += 1
            return None
        event = free.pop()
        stream = self._stream(device)
        if self._record(event, stream):
            free.append(event)
            self._record_failed()
            return None
        return (event, device, stream)

    def _end(self, op: OpState, token: tuple, callback: Callable[[float], None] | None) -> None:
        start, device, stream = token
        free = self._free[device]
        self.sampled = sampled = self.sampled + 1
        measure = not sampled % self._measure_every
        if measure:
            t0 = time.perf_counter_ns()
        if not free:
            free.append(start)
            self.dropped["pool_empty"] += 1
            return
        if len(self._ring) >= self.ring_size:
            free.append(start)
            self.dropped["ring_full"] += 1
            return
        end = free.pop()
        if self._record(end, stream):
            free.append(end)
            free.append(start)
            self._record_failed()
            return
        # (op, device, stream, start, end, trace id, callback, keep end: it starts the next region)
        self._ring.append((op, device, stream, start, end, self._trace_get(), callback, False))
        if measure:
            # One end costs about what one start costs (a record and a container op each).
            cost = 2e-9 * (time.perf_counter_ns() - t0)
            self.hot_path_s = cost if not self.hot_path_s else 0.9 * self.hot_path_s + 0.1 * cost


class Sequence:
    """Back-to-back regions sharing their boundary event: ``split(op)`` ends the open region and
    starts ``op``'s with one record; ``end()`` closes the last. One sequence per thread at a time.

    Sampling is decided per pass (``begin``): a sampled pass times every region in it.
    """

    __slots__ = ("_device", "_event", "_op", "_pass", "_shared", "_stream", "_timer", "active")

    def __init__(self, timer: Timer, name: str = "sequence") -> None:
        self._timer = timer
        self._pass = OpState(name, timer._period, timer._fixed_rate)
        self._op: OpState | None = None
        self._event: Any = None
        self._device = 0
        self._stream = 0
        self._shared = False
        self.active = False

    def begin(self, sampled: bool | None = None) -> bool:
        """Start a pass; True when this pass is timed. ``sampled`` overrides the sequence's own
        sampling (instrument() decides per forward pass itself)."""
        timer, state = self._timer, self._pass
        if sampled is None:
            if not state.fixed:
                state.period = max(1, timer._period)
            countdown = state.countdown
            if countdown:
                state.countdown = countdown - 1
                self.active = False
                return False
            state.countdown = state.period - 1
        if not sampled and sampled is not None:
            self.active = False
            return False
        if timer._captures[0] and timer._capturing():
            timer._note_capture()
            self.active = False
            return False
        self.active = True
        self._op = None
        self._shared = False
        return True

    def split(self, op: OpState | str) -> None:
        """End the open region (if any) and start ``op``'s at this point of the stream."""
        timer = self._timer
        if isinstance(op, str):
            op = timer.op_state(op)
        op.entered += 1
        if not self.active:
            return
        device = timer._device()
        try:
            free = timer._free[device]
        except KeyError:
            free = timer._add_device(device)
        if not free:
            timer.dropped["pool_empty"] += 1
            self._close_open(None)
            return
        event = free.pop()
        stream = timer._stream(device)
        if timer._record(event, stream):
            free.append(event)
            timer._record_failed()
            self._close_open(None)
            return
        self._shared = self._close_open(event)
        self._op, self._event, self._device, self._stream = op, event, device, stream

    def end(self) -> None:
        """Close the last region of the pass."""
        if not self.active:
            return
        self.active = False
        if self._op is None:
            return
        timer = self._timer
        free = timer._free[self._device]
        if not free:
            timer.dropped["pool_empty"] += 1
            self._close_open(None)
            return
        event = free.pop()
        if timer._record(event, self._stream):
            free.append(event)
            timer._record_failed()
            self._close_open(None)
            return
        self._close_open(event, last=True)
        self._op = None

    def _close_open(self, end: Any, last: bool = False) -> bool:
        """Queue (open start → end); True when ``end`` is now shared with a queued pair.

        A start that is the end of an earlier queued pair may be re-recorded only after that pair
        is resolved, so even dropped pairs go through the ring (with no op) to release in order.
        """
        timer, op, start = self._timer, self._op, self._event
        if op is None:
            return False
        self._op = None
        ring = timer._ring
        if end is None:  # the boundary could not be recorded: the open region is lost
            if self._shared:
                ring.append((None, self._device, self._stream, start, None, None, None, False))
            else:
                timer._free[self._device].append(start)
            return False
        if len(ring) >= timer.ring_size:
            timer.dropped["ring_full"] += 1
            op = None
        ring.append((op, self._device, self._stream, start, end, timer._trace_get(), None, not last))
        return not last

    def __enter__(self) -> Sequence:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
