"""The timer's hot path, in C where the extension is built and in Python everywhere else.

Two implementations of the same steps, chosen per timer (``use_native``):

- ``_hotpath.c``, built by ``pip install`` where a C compiler and Python's headers are present.
  It links nothing from CUDA: the ``cudart-ctypes`` route hands it the address of
  ``cudaEventRecord`` in the libcudart torch already loaded, and it calls that directly, without
  the Python frames and ctypes conversions that kept a fully timed forward well above the cost of
  two raw records per region (docs/design.md, "The hot path in C").
- ``PyHotPath`` and ``PySequenceBase`` below: the fallback when the extension is not built (or
  ``GPUSCOPE_TIMING_NATIVE=0``), and the readable statement of what the C code does.

Each offers ``record_start()`` / ``end(op, token, callback)`` for one ``TimerCore``, the
state plus ``split(op)`` / ``_close_open(end, last)`` of a ``Sequence``, the per-module
forwards ``instrument()`` installs, and the data model its ops live in (``OpState`` and its
histograms: ``histogram.py``, ``op_state_class``). Everything rare (a new
device's pool, a region inside a graph capture, a failed record) is handled by the core's and the
sequence's Python methods, which both implementations call.

Where the route gives the addresses of CUDA's event functions (``recycler_addresses``), the C hot
path hands plain pairs to a *recycler*: a thread of the extension that never takes the GIL, reads
finished pairs every ``RECYCLE_INTERVAL_S`` and gives their events straight back, so the
inference thread re-records events it used a few milliseconds ago and the resolver thread only
moves the elapsed times into histograms (``HotPath.collect``). Without a
recycler (``GPUSCOPE_TIMING_RECYCLER=0``), plain pairs go to the resolver's C loop
(``resolve_loop``), which asks CUDA with the GIL released.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from gpuscope.timing.histogram import OpState

try:
    from gpuscope.timing import _hotpath
except ImportError:  # no compiler where gpuscope was installed: the Python version serves
    _hotpath = None

#: Set to 0 to use the Python hot path even where the C one is built.
NATIVE_ENV = "GPUSCOPE_TIMING_NATIVE"
#: Set to 0 to leave plain pairs to the resolver's loop even where the recycler could run.
RECYCLER_ENV = "GPUSCOPE_TIMING_RECYCLER"
#: How often the recycler thread looks for finished pairs while any are queued (it backs off when
#: idle). Polling more often cost the launch-bound workload throughput even without the GIL: the
#: thread's wake-ups and CUDA calls compete with the inference thread (docs/design.md, "The hot path
#: in C", the recycler); at this interval the events in flight still stay in the tens.
RECYCLE_INTERVAL_S = 0.01
#: Measure the in-context cost of every Nth sampled pair (two clock reads each).
MEASURE_EVERY = 16
_RECYCLER_FUNCTIONS = ("query_address", "elapsed_address", "clear_error_address", "set_device_address")


def native_available() -> bool:
    """Whether the C hot path was built with this installation."""
    return _hotpath is not None


log = logging.getLogger("gpuscope.timing")
_warned_not_built = False


def use_native(native: bool | None) -> bool:
    """The choice for a new timer: ``native`` if given, else the C path unless the env var says 0.
    Where the C path is not built (an install without a compiler) the Python one serves, once with a
    warning: it costs more a region, and under default torch.compile a budget that held on the C path
    was measured over it (BERT-base on an H100: 2.55% against 0.13%, docs/design.md)."""
    global _warned_not_built
    if native is None:
        wanted = os.environ.get(NATIVE_ENV, "1") != "0"
        if wanted and _hotpath is None and not _warned_not_built:
            _warned_not_built = True
            log.warning("gpuscope: the timer's C hot path is not built, so timing runs in Python and costs "
                        "more per region; reinstall gpuscope where a C compiler and Python's headers are "
                        "present (pip install -e .), or set %s=0 to choose the Python path", NATIVE_ENV)
        return _hotpath is not None and wanted
    if native and _hotpath is None:
        raise RuntimeError("the C hot path is not built: reinstall gpuscope where a C compiler and "
                           "Python's headers are present (pip install -e .)")
    return bool(native)


def recycler_addresses(route: Any, recycler: bool | None) -> tuple[int, int, int, int, int]:
    """The CUDA functions a C hot path's recycler calls (query, elapsed time, last error, set device,
    capture mode), or zeros for none: not asked for (``recycler`` False, or None and the environment
    sets ``GPUSCOPE_TIMING_RECYCLER=0``) or a route that cannot give them (the host route, torch's)."""
    if recycler is None:
        recycler = os.environ.get(RECYCLER_ENV, "1") != "0"
    addresses = [getattr(route, name, 0) or 0 for name in (*_RECYCLER_FUNCTIONS, "capture_mode_address")]
    if not recycler or not all(addresses[:4]):
        return (0, 0, 0, 0, 0)
    return tuple(addresses)  # type: ignore[return-value]


class PyHotPath:
    """``record_start`` and ``end`` of one core, in Python (the C version does the same steps, and
    can hand pairs to a recycler thread, which this one never does)."""

    recycling = False
    queued = 0

    def __init__(self, *, core: Any, pools: dict, ring: Any, ring_size: int, dropped: dict, record: Any,
                 record_address: int, current_device: Any, current_stream: Any, trace_var: Any,
                 captures: list, capturing: Any, pending_type: type, graph_token_type: type,
                 measure_every: int, recycler_addresses: tuple, recycle_interval_s: float) -> None:
        self.core, self.pools, self.ring, self.ring_size, self.dropped = core, pools, ring, ring_size, dropped
        self.record, self.current_device, self.current_stream = record, current_device, current_stream
        self.trace_id = trace_var.get
        self.captures, self.capturing = captures, capturing
        self.pending_type, self.graph_token_type = pending_type, graph_token_type
        self.measure_every = measure_every
        self.sampled = 0
        self.hot_path_s = 0.0

    def free_list(self, device: int) -> list:
        try:
            return self.pools[device]
        except KeyError:
            return self.core.add_device(device)

    def record_start(self) -> Any:
        device = self.current_device()
        if self.captures[0] and self.capturing():
            return self.core.record_captured(device)
        free = self.free_list(device)
        if not free:
            self.dropped["pool_empty"] += 1
            return None
        event = free.pop()
        stream = self.current_stream(device)
        if self.record(event, stream):
            free.append(event)
            self.core.record_failed()
            return None
        return (event, device, stream)

    def end(self, op: Any, token: Any, callback: Any) -> None:
        if token.__class__ is self.graph_token_type:
            token.recorder.end(op, token)
            return
        start, device, stream = token
        free = self.pools[device]
        self.sampled = sampled = self.sampled + 1
        measure = not sampled % self.measure_every
        if measure:
            t0 = time.perf_counter_ns()
        if not free or len(self.ring) >= self.ring_size:
            free.append(start)
            self.dropped["pool_empty" if not free else "ring_full"] += 1
            return
        end = free.pop()
        if self.record(end, stream):
            free.append(end)
            free.append(start)
            self.core.record_failed()
            return
        self.ring.append(self.pending_type(op, device, stream, start, end, self.trace_id(), callback, False))
        if measure:
            # One end costs about what one start costs (a record and a container op each).
            cost = 2e-9 * (time.perf_counter_ns() - t0)
            self.hot_path_s = cost if not self.hot_path_s else 0.9 * self.hot_path_s + 0.1 * cost


class PySequenceBase:
    """State, ``split`` and ``_close_open`` of a ``Sequence``, in Python."""

    __slots__ = ("_core", "_device", "_event", "_hot", "_op", "_pass", "_recorder", "_shared", "_stream",
                 "active")

    def split(self, op: Any) -> None:
        """End the open region (if any) and start ``op``'s at this point of the stream."""
        core, hot = self._core, self._hot
        if isinstance(op, str):
            op = core.op_state(op)
        op.entered += 1
        if not self.active:
            return
        device = hot.current_device()
        if self._recorder is not None:
            self._split_captured(op, device)
            return
        free = hot.free_list(device)
        if not free:
            hot.dropped["pool_empty"] += 1
            self._close_open(None)
            return
        event = free.pop()
        stream = hot.current_stream(device)
        if hot.record(event, stream):
            free.append(event)
            core.record_failed()
            self._close_open(None)
            return
        self._shared = self._close_open(event)
        self._op, self._event, self._device, self._stream = op, event, device, stream

    def _close_open(self, end: Any, last: bool = False) -> bool:
        """Queue (open start → end); True when ``end`` is now shared with a queued pair.

        A start that is the end of an earlier queued pair may be re-recorded only after that pair
        is resolved, so even dropped pairs go through the ring (with no op) to release in order.
        """
        hot, op, start = self._hot, self._op, self._event
        if op is None:
            return False
        self._op = None
        ring, pending = hot.ring, hot.pending_type
        if end is None:  # the boundary could not be recorded: the open region is lost
            if self._shared:
                ring.append(pending(None, self._device, self._stream, start, None, None, None, False))
            else:
                hot.free_list(self._device).append(start)
            return False
        if len(ring) >= hot.ring_size:
            hot.dropped["ring_full"] += 1
            op = None
        ring.append(pending(op, self._device, self._stream, start, end, hot.trace_id(), None, not last))
        return not last


class PyRegionMarks:
    """The markers of one compiled model (``compiled.py``), in Python: what a marker in the compiled
    code does (``mark``) and the timed pass around them (``arm``/``disarm``). The C version
    (``_hotpath.RegionMarks``) does the same steps; Inductor's code calls it through
    ``_hotpath.MarkTable`` with no Python frame.

    Where two markers touch (no kernel emitted between them), the later one reuses the earlier
    one's event: an action ``(group, op, reuse_from, keep)`` names the slot (2 × index + is_end)
    whose event it reuses (-1: none) and whether a later marker reuses this end's event. The earlier
    marker is always an end, so the shared event is the end of a queued pair kept (``keep_end``)
    until the later pair that uses it is read, as a sequence's boundary is; a kept event no marker
    takes goes back in order (a pair without an op on the ring)."""

    def __init__(self, hot: Any, regions: int, captured: Any) -> None:
        self.hot = hot
        self.core = hot.core
        #: two per region (start, end): None (inside a merged group), (group, op) or
        #: (group, op, reuse_from, keep)
        self.actions: list[Any] = [None] * (2 * regions)
        #: the open start of each group, by its root region: (event, device, stream) recorded by
        #: it, or (event, device, stream, shared) reused from a queued pair's end
        self.tokens: list[Any] = [None] * regions
        self.captured = captured
        self.owner: int | None = None
        self.eager_marks = 0
        self.stray_marks = 0
        self.records = 0  # events recorded by the armed pass's markers
        self._boundary: tuple[Any, int, Any, int] | None = None  # (event, device, stream, kept by slot)

    @property
    def armed(self) -> bool:
        return self.owner is not None

    def mark(self, index: int, is_end: int) -> None:
        if threading.get_ident() != self.owner:
            self.stray_marks += 1
            return
        core = self.core
        if core.capture_in_progress():
            self.captured(index, is_end)
            return
        self.eager_marks += 1
        at = 2 * index + is_end
        action = self.actions[at]
        if action is None:  # inside a merged group
            return
        group, op = action[0], action[1]
        reuse_from, keep = (action[2], action[3]) if len(action) == 4 else (-1, False)
        boundary = self._boundary
        reuse = boundary is not None and reuse_from >= 0 and boundary[3] == reuse_from
        if boundary is not None and not reuse:
            self._release_boundary()
        tokens = self.tokens
        if not is_end:
            if reuse:
                self._boundary = None
                self._put(group, (*boundary[:3], True))
                return
            token = core.record_start()
            if token.__class__ is tuple:
                self.records += 1
            self._put(group, token)
            return
        token = tokens[group]
        if token is None:
            self._release_boundary()
            return
        tokens[group] = None
        if token.__class__ is not tuple:  # a captured region's token (graphs.py)
            core.end(op, token, None)
            return
        self._end(op, token, at, reuse, keep)

    def _end(self, op: Any, token: tuple, at: int, reuse: bool, keep: bool) -> None:
        hot = self.hot
        start, device, stream = token[0], token[1], token[2]
        end = None
        boundary = self._boundary
        if reuse and boundary is not None and boundary[1] == device and boundary[2] == stream:
            end, self._boundary = boundary[0], None
        self._release_boundary()
        free = hot.pools[device]
        if len(hot.ring) >= hot.ring_size or (end is None and not free):
            hot.dropped["ring_full" if len(hot.ring) >= hot.ring_size else "pool_empty"] += 1
            self._drop(token)
            if end is not None:
                self._release(end, device, stream, True)
            return
        if end is None:
            end = free.pop()
            if hot.record(end, stream):
                free.append(end)
                self._drop(token)
                self.core.record_failed()
                return
            self.records += 1
        hot.ring.append(hot.pending_type(op, device, stream, start, end, hot.trace_id(), None, keep))
        if keep:
            self._boundary = (end, device, stream, at)

    def _release(self, event: Any, device: int, stream: Any, shared: bool) -> None:
        """Give back an event: at once, or when it is a queued pair's kept end, once that pair is
        read (a pair without an op releases it in order)."""
        hot = self.hot
        if shared:
            hot.ring.append(hot.pending_type(None, device, stream, event, None, None, None, False))
        else:
            hot.free_list(device).append(event)

    def _release_boundary(self) -> None:
        boundary, self._boundary = self._boundary, None
        if boundary is not None:
            self._release(boundary[0], boundary[1], boundary[2], True)

    def _drop(self, token: tuple) -> None:
        self._release(token[0], token[1], token[2], len(token) == 4)

    def _put(self, group: int, token: Any) -> None:
        old, self.tokens[group] = self.tokens[group], token
        if old.__class__ is tuple:  # a start that never ended (a pass that raised half-way)
            self._drop(old)

    def arm(self) -> None:
        self.owner = threading.get_ident()
        self.eager_marks = 0
        self.records = 0
        self._clear()

    def disarm(self) -> None:
        self.owner = None
        self._clear()

    def _clear(self) -> None:
        self._release_boundary()
        for group, token in enumerate(self.tokens):
            if token is not None:
                self._put(group, None)


def region_marks(core: Any, regions: int, captured: Any) -> Any:
    """The markers of one compiled model with ``regions`` regions: ``_hotpath.RegionMarks`` on the C
    hot path, else ``PyRegionMarks``. ``captured(index, is_end)`` handles a marker met while a CUDA
    graph is captured."""
    cls = _hotpath.RegionMarks if core.native else PyRegionMarks
    return cls(core.hot, regions, captured)


def mark_table(entries: list, fallback: Any) -> Any:
    """The callable Inductor's code calls at each region marker, ``table(x, slot)``: a
    ``_hotpath.MarkTable`` over compiled.py's region table, or ``fallback`` itself without the
    extension."""
    return _hotpath.MarkTable(entries, fallback) if _hotpath is not None else fallback


def resolve_loop(route: Any, *, dropped: dict, pending_type: type) -> Any:
    """The resolver's C loop for plain pairs (``_hotpath.Resolve``), or None: without the extension,
    or for a route that cannot give CUDA's query, elapsed-time and last-error functions' addresses
    (the resolver then does every pair in Python)."""
    addresses = [getattr(route, name, 0) or 0 for name in ("query_address", "elapsed_address",
                                                             "clear_error_address")]
    if _hotpath is None or not all(addresses):
        return None
    query, elapsed, clear = addresses
    return _hotpath.Resolve(query_address=query, elapsed_address=elapsed, clear_error_address=clear,
                            dropped=dropped, pending_type=pending_type)


def exact_forward(core: Any, op: Any, original: Any) -> Any:
    """instrument()'s per-module forward for an exact region in C, or None on the Python hot path
    (instrument.py's ``_exact_forward`` is the Python version)."""
    return _hotpath.ExactForward(core.hot, op, original) if core.native else None


def split_forward(core: Any, local: Any, get_seq: Any, op: Any, original: Any) -> Any:
    """instrument()'s per-module forward for a shared boundary in C, or None on the Python hot path
    (instrument.py's ``_split_forward`` is the Python version)."""
    return _hotpath.SplitForward(local, get_seq, op, original) if core.native else None


def hot_path_class(native: bool) -> type:
    """The class of a core's hot path: ``_hotpath.HotPath`` or ``PyHotPath``."""
    return _hotpath.HotPath if native else PyHotPath


def op_state_class(native: bool) -> type[OpState]:
    """The class of a core's op states: ``_hotpath.OpState``, which the C hot path requires, or
    ``histogram.OpState``."""
    return _hotpath.OpState if native else OpState


def sequence_base(native: bool) -> type:
    """The base class holding a sequence's state and ``split``: C or Python."""
    return _hotpath.SequenceBase if native else PySequenceBase
