"""One thread per collector: a round every interval, each device on its own lane with a timeout.

A slow collector (energy, one of NVML's slowest calls: docs/design.md, "NVML and nvidia-smi") never
delays a fast one because each has its own thread; a wedged call never delays the other devices
because each device runs on its own lane and the sampler stops waiting after
``--nvml.call-timeout``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from functools import partial

from gpuscope.nvml.calls import Calls, DeviceLost
from gpuscope.nvml.collectors import Collector
from gpuscope.nvml.devices import Device
from gpuscope.nvml.health import Health
from gpuscope.nvml.lane import Lane
from gpuscope.nvml.store import Store


class Sampler:
    """Runs ``collector`` over ``devices`` every ``interval`` seconds on a daemon thread."""

    def __init__(self, collector: Collector, devices: Sequence[Device], interval: float, timeout: float,
                 store: Store, health: Health, calls: Calls) -> None:
        self.collector = collector
        self.devices = [d for d in devices if collector.applies(d)]
        self.interval = interval
        self.timeout = timeout
        self.store = store
        self.health = health
        self.calls = calls
        self.lanes = {d.label: Lane(f"gpuscope-{collector.name}-gpu{d.label}") for d in self.devices}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpuscope-{collector.name}", daemon=True)
        store.register(collector.name)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        for lane in self.lanes.values():
            lane.stop()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def wedged(self) -> bool:
        return any(lane.busy for lane in self.lanes.values())

    def _loop(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            self.run_round()
            # Keep the cadence; after an overrun, skip missed ticks instead of bursting.
            due = max(due + self.interval, time.monotonic())
            self._stop.wait(due - time.monotonic())

    def run_round(self) -> bool:
        """Sample every device once; True when every live device answered in time."""
        name, started, ok = self.collector.name, time.monotonic(), True
        for device in self.devices:
            if self._stop.is_set():
                return ok
            if self.health.is_lost(device.label):
                self.store.drop(name, device.label)
                continue
            lane = self.lanes[device.label]
            finished, samples, error = lane.run(partial(self.collector.sample, device), self.timeout)
            if self._stop.is_set():
                return ok  # shutting down: neither a hang nor a result
            if not finished:
                ok = False
                self._report_hang(device, lane)
                self.store.mark_down(name, device.label)
            elif isinstance(error, DeviceLost):
                self.store.drop(name, device.label)
            elif error is not None:
                ok = False
                self.health.count_error("internal")
                self.health.log_once(("internal", name, type(error).__name__), logging.ERROR,
                                     "collector %s failed on gpu %s: %r (counted as call=\"internal\")",
                                     name, device.label, error)
                self.store.mark_down(name, device.label)
            else:
                self.store.publish(name, device.label, samples, up=bool(samples))
        self.store.finish_round(name, time.monotonic() - started, ok)
        return ok

    def _report_hang(self, device: Device, lane: Lane) -> None:
        in_flight = self.calls.in_flight(lane.ident)
        if in_flight is None:
            return  # it returned just after the deadline
        call = in_flight[0]
        key = ("hang", self.collector.name, device.label, call)
        # Count a hang once per wedged call, not once per round it stays wedged.
        if not lane.hang_reported:
            lane.hang_reported = True
            self.health.count_error(call)
        self.health.log_once(key, logging.WARNING,
                             "gpu %s: %s did not answer within %.3gs; %s values go stale until it does",
                             device.label, call, self.timeout, self.collector.name)
