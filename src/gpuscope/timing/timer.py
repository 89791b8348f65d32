"""The objects users hold: ``Timer``, its ``Region`` and ``Handle``.

A timer is three parts with one job each: the core (``core.py``: pools, ring, drop counters,
sampling period, op states and the hot path), the resolver thread (``resolver.py``: waits for
the GPU and fills histograms) and the budget controller (``budget.py``: sets the sampling period).
This module wires them together and offers the user API.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from gpuscope.timing.budget import BudgetController
from gpuscope.timing.busy import CuptiTrace, KernelBusy, KernelTrace
from gpuscope.timing.collector import TimerCollector
from gpuscope.timing.core import DROP_REASONS, OpState, TimerCore, current_trace_id, trace
from gpuscope.timing.graphs import TimedGraph
from gpuscope.timing.instrument import Instrumentation, instrument
from gpuscope.timing.resolver import Resolver
from gpuscope.timing.routes import Route, pick_route
from gpuscope.timing.sequence import Sequence, new_sequence

__all__ = ["DROP_REASONS", "Handle", "OpState", "Region", "Sequence", "Timer", "current_trace_id", "trace"]


class Region:
    """``with timer.region("op"):`` or ``@timer.region("op")``; reusable and thread-safe."""

    __slots__ = ("_begin", "_end", "_local", "_op")

    def __init__(self, core: TimerCore, op: OpState, local: threading.local) -> None:
        self._begin, self._end, self._local, self._op = core.begin, core.end, local, op

    def __enter__(self) -> Region:
        token = self._begin(self._op)
        local = self._local
        try:
            local.stack.append(token)
        except AttributeError:
            local.stack = [token]
        return self

    def __exit__(self, *exc: object) -> None:
        token = self._local.stack.pop()
        if token is not None:
            self._end(self._op, token, None)

    def __call__(self, fn: Callable) -> Callable:
        begin, end, op = self._begin, self._end, self._op

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


#: The timer collector each registry holds: a new timer replaces a closed one's (one per registry,
#: else a scrape would carry every family twice).
_REGISTERED: weakref.WeakKeyDictionary[CollectorRegistry, TimerCollector] = weakref.WeakKeyDictionary()


class Timer:
    """Times GPU work with CUDA events (or wall time on CPU-only machines) into Prometheus histograms.

    Args:
        registry: where the timer's metrics are registered (None: nowhere). One timer per registry:
            a second one's names are already there, and registering it raises ``ValueError``.
        backend: "auto" (CUDA if available, else host), "cuda", "host", or a route name.
        budget: share of wall time the timer may cost; sampling adapts to stay within it.
            Ignored when ``sample_rate`` is given.
        sample_rate: fixed share of regions to time (1.0 = every region).
        resolve_interval: seconds between resolver wake-ups (tens of ms: a fast-polling
            thread steals the GIL from the inference thread).
        pool_size: events preallocated per device (on the first region timed on that device).
        ring_size: sampled regions that may wait for the GPU before new ones are dropped.
        calibrate_every: seconds between baseline re-calibrations (0: only when a device is new).
        native: the C hot path (True), the Python one (False), or None: C where it is built, unless
            the environment sets ``GPUSCOPE_TIMING_NATIVE=0`` (``timing/hot.py``).
        recycler: with the C hot path on a CUDA runtime route, read finished pairs and recycle
            their events from a thread that never takes the GIL (None: yes, unless the environment
            sets ``GPUSCOPE_TIMING_RECYCLER=0``); False leaves them to the resolver's loop.

    The timer records on the current device's current stream: a thread that runs work on a GPU
    other than device 0 makes it current (``torch.cuda.set_device``), as serving engines do.
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
        native: bool | None = None,
        recycler: bool | None = None,
    ) -> None:
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if sample_rate is None and not 0 < budget < 1:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        if resolve_interval <= 0 or pool_size < 4 or ring_size < 1:
            raise ValueError("resolve_interval must be > 0, pool_size >= 4 and ring_size >= 1")
        # Budget mode starts cautious and lets the controller raise the rate within a second.
        period = 1 if sample_rate is not None and sample_rate >= 1 else (
            max(1, round(1 / sample_rate)) if sample_rate is not None else 16)
        # No event pool yet: a device's events are made where it is first used. A server picks its
        # device after creating the timer, and making events on whatever device is current here
        # would open a CUDA context (hundreds of MiB) on a GPU the program never uses.
        self.core = TimerCore(route or pick_route(backend), pool_size=pool_size, ring_size=ring_size,
                              period=period, fixed_rate=sample_rate is not None,
                              budget=0.0 if sample_rate is not None else budget, native=native,
                              recycler=recycler)
        self.budget_controller = BudgetController(self.core)
        self.resolver = Resolver(self.core, self.budget_controller, resolve_interval=resolve_interval,
                                 calibrate_every=calibrate_every)
        self._regions: dict[str, Region] = {}
        self._local = threading.local()
        if registry is not None:  # first: a registry that refuses its names leaves no thread behind
            collector = TimerCollector(self.core, self.resolver, self.budget_controller)
            previous = _REGISTERED.get(registry)
            if previous is not None and previous.core.closed:
                registry.unregister(previous)  # a closed timer's names go to its successor
            registry.register(collector)
            _REGISTERED[registry] = collector
        self._registry = registry
        self.resolver.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (t := ref()) is not None and t.close(timeout=1.0))

    # --- user API ---------------------------------------------------------------------------

    @property
    def route(self) -> Route:
        return self.core.route

    @property
    def dropped(self) -> dict[str, int]:
        """Samples lost so far, by reason."""
        return self.core.dropped

    @property
    def closed(self) -> bool:
        return self.core.closed

    def region(self, op: str) -> Region:
        """The region object for ``op`` (cached): a context manager and a decorator."""
        region = self._regions.get(op)
        if region is None:
            region = self._regions[op] = Region(self.core, self.core.op_state(op), self._local)
        return region

    def start(self, op: str, on_elapsed: Callable[[float], None] | None = None) -> Handle:
        """Start timing ``op``; with ``on_elapsed`` the region is always timed and the callback
        gets its GPU seconds on the resolver thread."""
        core = self.core
        state = core.op_state(op)
        if on_elapsed is None:
            return Handle(state, core.begin(state), None)
        state.entered += 1
        state.always += 1
        return Handle(state, core.record_start(), on_elapsed)

    def stop(self, handle: Handle) -> None:
        """End the region ``handle`` started (a second stop of the same handle does nothing)."""
        token, handle.token = handle.token, None
        if token is not None:
            self.core.end(handle.op, token, handle.callback)

    def sequence(self) -> Sequence:
        """Contiguous regions that share boundary events (N+1 records for N regions)."""
        return new_sequence(self.core)

    def instrument(self, model: Any, include: Any = None, *, mode: str = "exact",
                   op_name: Callable[[str], str] | None = None) -> Instrumentation:
        """Time chosen submodules of a ``torch.nn.Module``; see ``gpuscope.timing.instrument``."""
        return instrument(self, model, include, mode=mode, op_name=op_name)

    def graph(self, step: Callable[[], Any], **options: Any) -> TimedGraph:
        """Capture ``step`` as CUDA graphs whose regions are timed on sampled replays
        (``gpuscope.timing.graphs.TimedGraph``; ``.replay()`` runs it and returns its output)."""
        return TimedGraph(self, step, **options)

    def enable_kernel_busy(self, trace: KernelTrace | None = None, **options: Any) -> KernelBusy:
        """Measure, in sampled CUPTI windows, how much of each instrumented module's region time its
        kernels keep the GPU busy (``gpuscope.timing.busy``; needs ``cupti-python``). Options:
        ``min_interval_s``, ``budget_share``."""
        if self.core.busy is None:
            self.core.busy = KernelBusy(self.core, trace if trace is not None else CuptiTrace(), **options)
        return self.core.busy

    def op_state(self, op: str) -> OpState:
        return self.core.op_state(op)

    def set_sample_rate(self, op: str, rate: float) -> None:
        """Fix one op's sampling rate (exempt from budget adaptation)."""
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        state = self.core.op_state(op)
        state.period = max(1, round(1 / rate))
        state.fixed = True

    def sampling_period(self) -> int:
        """The period the budget currently sets (1: every region timed)."""
        return self.core.period

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (polling) until every recorded sample is resolved; True if the ring emptied in time."""
        return self.resolver.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the resolver, resolve what completes within ``timeout``, destroy every event. Its
        metrics stay readable until a new timer takes its registry."""
        if self.core.closed:
            return
        self.core.closed = True
        if self.core.busy is not None:
            self.core.busy.close()
        self.resolver.stop(timeout)
        self.core.close_pools()

    def __enter__(self) -> Timer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
