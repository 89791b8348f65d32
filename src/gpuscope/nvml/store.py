"""Cached device state: what samplers publish and what a scrape reads.

Samplers replace a device's sample list whole; a reader takes a shallow copy under a lock
that is never held across an NVML call, so its cost does not depend on NVML. The end of every
round sets ``changed``, which tells the renderer (``rendered.py``) that the exposition is out of
date: a round's per-device changes are rendered together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuscope.nvml.collectors import Sample


@dataclass(frozen=True)
class DeviceData:
    samples: Sequence[Sample]
    at: float  # wall-clock time the values were read
    up: bool  # the device answered this collector's last round


@dataclass
class CollectorState:
    devices: dict[str, DeviceData] = field(default_factory=dict)
    duration: float = 0.0  # last round, seconds
    last_success: float = 0.0  # wall clock; 0 = never
    last_round: float = 0.0  # wall clock of the last round's end, whatever its outcome


class Store:
    """Latest samples per (collector, device), plus per-collector round bookkeeping."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self._state: dict[str, CollectorState] = {}
        self.changed = threading.Event()

    def register(self, collector: str) -> None:
        with self._lock:
            self._state.setdefault(collector, CollectorState())
        self.changed.set()

    def unregister(self, collector: str) -> None:
        with self._lock:
            self._state.pop(collector, None)
        self.changed.set()

    def publish(self, collector: str, gpu: str, samples: Sequence[Sample], up: bool = True) -> None:
        data = DeviceData(tuple(samples), self.clock(), up)
        with self._lock:
            self._state.setdefault(collector, CollectorState()).devices[gpu] = data

    def mark_down(self, collector: str, gpu: str) -> None:
        """A device that did not answer: keep its last values (staleness shows their age), up=0."""
        with self._lock:
            state = self._state.setdefault(collector, CollectorState())
            old = state.devices.get(gpu)
            state.devices[gpu] = DeviceData(old.samples if old else (), old.at if old else self.started,
                                            False)

    def drop(self, collector: str, gpu: str) -> None:
        """A lost GPU: its last values would mislead, so serve none."""
        with self._lock:
            state = self._state.get(collector)
            if state is not None:
                state.devices.pop(gpu, None)

    def finish_round(self, collector: str, duration: float, ok: bool) -> None:
        now = self.clock()
        with self._lock:
            state = self._state.setdefault(collector, CollectorState())
            state.duration, state.last_round = duration, now
            if ok:
                state.last_success = now
        self.changed.set()

    def snapshot(self) -> dict[str, CollectorState]:
        with self._lock:
            return {name: CollectorState(dict(s.devices), s.duration, s.last_success, s.last_round)
                    for name, s in self._state.items()}

    def staleness(self, state: CollectorState, now: float) -> float:
        """Age of the oldest values a collector serves (of its last round when it serves none)."""
        if state.devices:
            return max(0.0, now - min(d.at for d in state.devices.values()))
        return max(0.0, now - (state.last_round or self.started))
