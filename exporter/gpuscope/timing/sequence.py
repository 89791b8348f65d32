"""Back-to-back regions sharing their boundary events: N+1 records for N regions.

``split(op)`` ends the open region and starts ``op``'s with one record; ``end()`` closes the
last. Sampling is decided per pass (``begin``): a sampled pass times every region in it.
"""

from __future__ import annotations

from typing import Any

from gpuscope.timing.core import OpState, Pending, TimerCore


class Sequence:
    """One pass of contiguous regions; one sequence per thread at a time."""

    __slots__ = ("_core", "_device", "_event", "_op", "_pass", "_recorder", "_shared", "_stream", "active")

    def __init__(self, core: TimerCore, name: str = "sequence") -> None:
        self._core = core
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

    def split(self, op: OpState | str) -> None:
        """End the open region (if any) and start ``op``'s at this point of the stream."""
        core = self._core
        if isinstance(op, str):
            op = core.op_state(op)
        op.entered += 1
        if not self.active:
            return
        device = core.current_device()
        if self._recorder is not None:
            self._split_captured(op, device)
            return
        try:
            free = core.pools[device]
        except KeyError:
            free = core.add_device(device)
        if not free:
            core.dropped["pool_empty"] += 1
            self._close_open(None)
            return
        event = free.pop()
        stream = core.current_stream(device)
        if core.record_event(event, stream):
            free.append(event)
            core.record_failed()
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
        self._close_open(event, last=True)
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

    def _close_open(self, end: Any, last: bool = False) -> bool:
        """Queue (open start → end); True when ``end`` is now shared with a queued pair.

        A start that is the end of an earlier queued pair may be re-recorded only after that pair
        is resolved, so even dropped pairs go through the ring (with no op) to release in order.
        """
        core, op, start = self._core, self._op, self._event
        if op is None:
            return False
        self._op = None
        ring = core.ring
        if end is None:  # the boundary could not be recorded: the open region is lost
            if self._shared:
                ring.append(Pending(None, self._device, self._stream, start, None, None, None, False))
            else:
                core.pools[self._device].append(start)
            return False
        if len(ring) >= core.ring_size:
            core.dropped["ring_full"] += 1
            op = None
        ring.append(Pending(op, self._device, self._stream, start, end, core.active_trace_id(), None,
                            not last))
        return not last

    def __enter__(self) -> Sequence:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
