"""The timer's shared state and its hot path: the one module every other timing module talks to.

``TimerCore`` holds what the timing modules share, under public names:

- ``pools``: per-device free lists of preallocated events (``add_device`` fills one);
- ``ring``: sampled pairs waiting for the GPU, as ``Pending`` tuples, in record order (with the C
  hot path's recycler, only pairs that need Python: callbacks and graph replays; ``pending()``
  counts both rings);
- ``dropped``: samples lost, by reason (``DROP_REASONS``);
- ``period``: the sampling period the budget controller sets (1 = every region);
- the op states (``op_state``, ``ops``: ``histogram.py``'s data model, C with the C hot path) and
  the per-pass samplers (``samplers``).

and the hot path: ``begin``, ``record_start`` and ``end`` (a sampled region costs two event
records, one pop from a free list and one append to the bounded ring; an unsampled one a counter
decrement). ``record_start`` and ``end`` come from ``hot.py``: C where the extension is built,
Python otherwise. The hot path takes no lock, does no I/O and allocates no CUDA resource;
everything else (waiting for the GPU, elapsed times, baselines, histograms, sampling adaptation)
happens on the resolver thread.

Counters are plain attributes bumped under the GIL; with several inference threads an increment
can very rarely be lost to a thread switch, which is the price of taking no lock.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from gpuscope.contract.catalogue import REGION_SECONDS_BUCKETS
from gpuscope.timing import capture, hot
from gpuscope.timing.histogram import OpState
from gpuscope.timing.routes import Route, on_device

log = logging.getLogger("gpuscope.timing")

DROP_REASONS = ("ring_full", "pool_empty", "graph_capture", "graph_busy", "error", "closed")

_trace_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("gpuscope_trace_id", default=None)


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


class Pending(NamedTuple):
    """A recorded pair in the ring. ``op`` None: a dropped pair kept only to release its events in
    order; ``keep_end``: the end event starts the next region of a sequence (released later)."""

    op: OpState | None
    device: int
    stream: int
    start: Any
    end: Any
    trace_id: str | None
    callback: Callable[[float], None] | None
    keep_end: bool


class GraphToken(NamedTuple):
    """A region's start recorded as a node of a CUDA graph being captured (see ``graphs.py``)."""

    event: Any
    device: int
    stream: int
    recorder: Any  # the GraphRecorder of the capture


def _repace(state: OpState, period: int) -> None:
    """A new period for an op or a sampler's passes, with the wait before its next timed one scaled
    to it: a countdown left from a longer period (up to the period times a run of timed passes,
    ``compiled.TIMED_RUN``) would otherwise hold the new rate off for that many passes (1,128 untimed
    passes of a decoder after its period fell from 142 to 1)."""
    old = state.period
    state.period = period
    if old > 0 and state.countdown:
        state.countdown = state.countdown * period // old


class TimerCore:
    """Shared state and hot path of one timer (module docstring)."""

    def __init__(self, route: Route, *, pool_size: int, ring_size: int, period: int, fixed_rate: bool,
                 budget: float, native: bool | None = None, recycler: bool | None = None) -> None:
        self.route = route
        self.is_host = bool(getattr(route, "on_host", False))
        self.pool_size = pool_size
        self.ring_size = ring_size
        self.budget = budget
        self.period = period
        self.fixed_rate = fixed_rate
        self.pools: dict[int, list[Any]] = {}
        self.ring: deque[Pending] = deque()
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.closed = False
        #: the kernel busy window (busy.KernelBusy) when switched on; instrument() passes consult it
        self.busy: Any = None
        #: called (under the ops lock) with a device whose pool was just made; the resolver calibrates it
        self.on_new_device: Callable[[int], None] = lambda device: None
        self._ops: dict[str, OpState] = {}
        self._samplers: list[Any] = []
        self._all_events: dict[int, list[Any]] = {}
        self._ops_lock = threading.Lock()  # only taken when a new op, sampler or device appears
        self._warned_capture = False
        self._graph_local = threading.local()  # .recorder while this thread captures a timed graph
        # The calls the hot path and graphs.py make, bound once.
        self.record_event = route.record
        self.current_device = route.current_device
        self.current_stream = route.current_stream
        self.active_trace_id = _trace_id.get
        self._captures = capture.in_progress
        self._capturing = route.is_capturing  # asked only while some capture is in progress
        if route.gpu_queue:
            capture.install()
        self.native = hot.use_native(native)
        #: the class of this timer's op states: C with the C hot path (whose loops update them through
        #: their structs), else histogram.OpState
        self.op_type: type[OpState] = hot.op_state_class(self.native)
        self.hot = hot.hot_path_class(self.native)(
            core=self, pools=self.pools, ring=self.ring, ring_size=ring_size, dropped=self.dropped,
            record=route.record, record_address=getattr(route, "record_address", 0) or 0,
            current_device=route.current_device, current_stream=route.current_stream, trace_var=_trace_id,
            captures=capture.in_progress, capturing=route.is_capturing, pending_type=Pending,
            graph_token_type=GraphToken, measure_every=hot.MEASURE_EVERY,
            recycler_addresses=hot.recycler_addresses(route, recycler) if self.native else (0, 0, 0, 0, 0),
            recycle_interval_s=hot.RECYCLE_INTERVAL_S)
        self.record_start: Callable[[], Any] = self.hot.record_start
        self.end: Callable[[OpState, Any, Callable[[float], None] | None], None] = self.hot.end

    @property
    def recycling(self) -> bool:
        """Whether plain pairs go to the C hot path's recycler thread (``hot.py``) instead of ``ring``."""
        return self.hot.recycling

    def pending(self) -> int:
        """Sampled pairs not yet observed: on ``ring`` and, with a recycler, in its own ring."""
        return len(self.ring) + self.hot.queued

    @property
    def hot_path_s(self) -> float:
        """CPU seconds of one sampled region, measured in context every few pairs."""
        return self.hot.hot_path_s

    # --- ops and samplers ---------------------------------------------------------------------

    def op_state(self, op: str) -> OpState:
        state = self._ops.get(op)
        if state is None:
            with self._ops_lock:
                state = self._ops.get(op)
                if state is None:
                    state = self._ops[op] = self._new_state(op)
        return state

    def new_pass_state(self, name: str) -> OpState:
        """Sampling state for a pass (instrument(), sequences), outside the op table."""
        return self._new_state(name)

    def _new_state(self, name: str) -> OpState:
        return self.op_type(name, self.period, self.fixed_rate, REGION_SECONDS_BUCKETS)

    def ops(self) -> list[OpState]:
        return list(self._ops.values())

    def samplers(self) -> list[Any]:
        return list(self._samplers)

    def register_sampler(self, sampler: Any) -> None:
        with self._ops_lock:
            self._samplers.append(sampler)

    def unregister_sampler(self, sampler: Any) -> None:
        with self._ops_lock:
            if sampler in self._samplers:
                self._samplers.remove(sampler)
            for op in sampler.op_states:
                op.owner = None if op.owner is sampler else op.owner

    def set_period(self, period: int) -> None:
        """The budget controller's decision: every op and pass that is not fixed follows it."""
        self.period = period
        for op in self.ops():
            if not op.fixed:
                _repace(op, period)
        for sampler in self.samplers():
            _repace(sampler.pass_state, period)

    def device_label(self, device: int) -> str:
        return "cpu" if self.is_host else str(device)

    # --- events ---------------------------------------------------------------------------------

    def add_device(self, device: int) -> list[Any]:
        """Preallocate a device's events (once per device; never on the steady-state hot path).

        The events are made with ``device`` current, whatever this thread's current device is
        in the runtime (torch may set it lazily). If that fails, the device keeps an empty pool:
        its regions are dropped as ``pool_empty`` after one counted ``error``, never retried."""
        with self._ops_lock:
            if self.closed:
                return []
            if device not in self.pools:
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
                    self.on_new_device(device)
                self._all_events[device] = events
                self.pools[device] = list(events)
        return self.pools[device]

    def fence_events(self, device: int) -> list[Any] | None:
        """The device's free events, for the fence event a timed graph replay records after itself;
        None, the drop counted, when the pool is empty or the ring is full (a replay is then untimed,
        never blocked). The pool is made on the device's first replay (``add_device``)."""
        try:
            free = self.pools[device]
        except KeyError:
            free = self.add_device(device)
        if not free or len(self.ring) >= self.ring_size:
            self.dropped["pool_empty" if not free else "ring_full"] += 1
            return None
        return free

    def close_pools(self) -> None:
        """Destroy every event (after the resolver has stopped); later regions find no pool."""
        self.closed = True
        for device, events in self._all_events.items():
            self.pools[device] = []
            self._destroy(device, events)
        self._all_events.clear()

    def _destroy(self, device: int, events: list[Any]) -> None:
        try:
            with on_device(self.route, device):
                for event in events:
                    self.route.destroy(event)
        except Exception:  # CUDA may already be torn down at exit
            pass

    def record_failed(self) -> None:
        """Count a failed record and clear CUDA's last-error slot, which torch checks after its next
        kernel launch: our failure must not surface as an exception in the caller's code."""
        self.dropped["error"] += 1
        self.route.clear_error()

    def capture_in_progress(self) -> bool:
        """True while the current stream is capturing a CUDA graph (cheap when none is, anywhere)."""
        return bool(self._captures[0]) and self._capturing()

    def graph_recorder(self) -> Any:
        """The recorder of the timed graph this thread is capturing, if any (``graphs.py``)."""
        return getattr(self._graph_local, "recorder", None)

    @contextmanager
    def recording_graph(self, recorder: Any) -> Iterator[None]:
        """Regions this thread enters while capturing become event nodes owned by ``recorder``."""
        self._graph_local.recorder = recorder
        try:
            yield
        finally:
            self._graph_local.recorder = None

    def note_capture(self) -> None:
        self.dropped["graph_capture"] += 1
        if not self._warned_capture:
            self._warned_capture = True
            log.warning("gpuscope: regions inside CUDA graph capture are not timed (capture left intact)")

    # --- the hot path's rare branches (hot.py calls them) --------------------------------------

    def begin(self, op: OpState) -> Any:
        """Count the region; if it is sampled, record its start event and return the token."""
        op.entered += 1
        countdown = op.countdown
        if countdown:
            op.countdown = countdown - 1
            return None
        op.countdown = op.period - 1
        return self.record_start()

    def record_captured(self, device: int) -> Any:
        """A region's start while this thread's stream captures a CUDA graph: an event node of the
        timed copy being captured (graphs.py), or nothing (counted) in a capture we do not time."""
        recorder = getattr(self._graph_local, "recorder", None)
        if recorder is None:
            self.note_capture()
            return None
        return recorder.start(device, self.current_stream(device))
