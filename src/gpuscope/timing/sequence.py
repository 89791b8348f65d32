"""Back-to-back regions sharing their boundary events: N+1 records for N regions.

``split(op)`` ends the open region and starts ``op``'s with one record; ``end()`` closes the
last. Sampling is decided per pass (``begin``): a sampled pass times every region in it.
``split`` and the queueing of pairs are the hot path and come from ``hot.py`` (C or Python,
as the core chose); this module holds the rest. ``new_sequence(core)`` makes one.
"""

from __future__ import annotations

from typing import Any

from gpuscope.timing.core import OpState, TimerCore
from gpuscope.timing.hot import native_available, sequence_base


class Sequence:
    """One pass of contiguous regions; one sequence per thread at a time. ``split(op)`` comes from
    the hot path's sequence base (``hot.py``)."""

    __slots__ = ()

    def __init__(self, core: TimerCore, name: str = "sequence") -> None:
        self._core = core
        self._hot = core.hot
        self._pass = core.new_pass_state(name)
        self._op: OpState | None = None
        self._event: Any = None
        self._device = 0
        self._stream = 0
        self._shared = False
        self._recorder: Any = None  # the timed graph copy being captured, if any (graphs.py)
        self.active = False

    def begin(self, sampled: bool | None = None) -> bool:
        """Start a pass; True when this pass is timed. ``sampled`` overrides the sequence's own
        sampling (instrument() decides per forward pass itself)."""
        core, state = self._core, self._pass
        if sampled is None:
            if not state.fixed:
                state.period = max(1, core.period)
            countdown = state.countdown
            if countdown:
                state.countdown = countdown - 1
                self.active = False
                return False
            state.countdown = state.period - 1
        if not sampled and sampled is not None:
            self.active = False
            return False
        self._recorder = None
        if core.capture_in_progress():
            recorder = core.graph_recorder()
            if recorder is None or not recorder.times_regions:
                if recorder is None:
                    core.note_capture()
                self.active = False
                return False
            self._recorder = recorder
        self.active = True
        self._op = None
        self._shared = False
        return True

    def end(self) -> None:
        """Close the last region of the pass."""
        if not self.active:
            return
        self.active = False
        if self._op is None:
            return
        core = self._core
        if self._recorder is not None:
            event = self._recorder.take(self._stream)
            if event is not None:
                self._recorder.add_pair(self._op, self._event, event)
            self._op = None
            return
        free = core.pools[self._device]
        if not free:
            core.dropped["pool_empty"] += 1
            self._close_open(None)
            return
        event = free.pop()
        if core.record_event(event, self._stream):
            free.append(event)
            core.record_failed()
            self._close_open(None)
            return
        self._close_open(event, True)
        self._op = None

    def _split_captured(self, op: OpState, device: int) -> None:
        """``split`` while a timed graph copy is captured: the boundary becomes an event node."""
        stream = self._core.current_stream(device)
        event = self._recorder.take(stream)
        if event is None:
            self._op = None
            return
        if self._op is not None:
            self._recorder.add_pair(self._op, self._event, event)
        self._op, self._event, self._device, self._stream = op, event, device, stream

    def __enter__(self) -> Sequence:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class _PySequence(Sequence, sequence_base(native=False)):
    __slots__ = ()


if native_available():
    class _NativeSequence(Sequence, sequence_base(native=True)):
        __slots__ = ()


def new_sequence(core: TimerCore, name: str = "sequence") -> Sequence:
    """A sequence on ``core``'s hot path (C or Python, as the core chose)."""
    cls = _NativeSequence if core.native else _PySequence
    return cls(core, name)
