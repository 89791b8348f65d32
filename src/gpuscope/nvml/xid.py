"""XID errors as events: a thread waits on an NVML event set and counts each XID by code.

dcgm-exporter keeps the *last* XID in a gauge, which cannot show a repeat (their #190);
here every event increments ``gpuscope_gpu_xid_errors_total{gpu,xid}`` and stamps
``gpuscope_gpu_xid_last_timestamp_seconds{gpu,xid}``::

    gpuscope_gpu_xid_errors_total{gpu="0",xid="79"} 2
    gpuscope_gpu_xid_last_timestamp_seconds{gpu="0",xid="79"} 1.7e+09

Well-known codes start at 0, so ``increase()`` sees the first event of each. The wait has
a timeout, so shutdown is prompt. Where registration is unsupported (some VMs, MIG-only
setups), the failure is counted and logged once, and the rest of the exporter carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.api import INVALID_ID, TIMEOUT, NVMLError, error_code, error_text, handle_key
from gpuscope.nvml.collectors import Sample
from gpuscope.nvml.devices import Device
from gpuscope.nvml.health import Health
from gpuscope.nvml.registry import register_collector
from gpuscope.nvml.store import Store

#: XIDs worth alerting on (NVIDIA's XID catalogue), exported at 0 from the start.
WELL_KNOWN_XIDS = (13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120)
NAME = "xid"


@register_collector(NAME, default=True, help="XID error events")
class XidWatcher:
    """Owns the event set and the XID counters; publishes them to the store after each wait."""

    def __init__(self, nv: Any, devices: Sequence[Device], store: Store, health: Health,
                 wait_ms: int = 500, clock: Callable[[], float] = time.time) -> None:
        self.nv = nv
        self.devices = [d for d in devices if not d.is_mig]  # XIDs are raised on the board
        self.by_key = {d.key: d for d in self.devices}
        self.store = store
        self.health = health
        self.wait_ms = wait_ms
        self.clock = clock
        self.counts: dict[tuple[str, int], int] = {
            (d.label, x): 0 for d in self.devices for x in WELL_KNOWN_XIDS}
        self.last: dict[tuple[str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuscope-xid", daemon=True)
        store.register(NAME)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _register(self) -> Any:
        try:
            event_set = self.nv.nvmlEventSetCreate()
        except NVMLError as exc:
            self._unsupported("nvmlEventSetCreate", exc)
            return None
        registered = 0
        for device in self.devices:
            try:
                xid_type = self.nv.nvmlEventTypeXidCriticalError
                self.nv.nvmlDeviceRegisterEvents(device.handle, xid_type, event_set)
                registered += 1
            except NVMLError as exc:
                self._unsupported("nvmlDeviceRegisterEvents", exc, device.label)
        if registered:
            return event_set
        self._free(event_set)
        return None

    def _unsupported(self, call: str, exc: BaseException, gpu: str = "*") -> None:
        self.health.count_error(call)
        self.health.log_once(("xid", call, gpu), logging.WARNING,
                             "XID events unavailable on gpu %s (%s: %s); other metrics continue",
                             gpu, call, error_text(exc))

    def _free(self, event_set: Any) -> None:
        try:
            self.nv.nvmlEventSetFree(event_set)
        except NVMLError:
            self.health.count_error("nvmlEventSetFree")

    def _run(self) -> None:
        event_set = self._register() if self.devices else None
        if event_set is None:
            # Zeros would claim "no XIDs" where none can be seen: serve no XID series at all.
            self.store.unregister(NAME)
            return
        self.publish()
        failures = 0
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    data = self.nv.nvmlEventSetWait(event_set, self.wait_ms)
                except NVMLError as exc:
                    if error_code(exc) != TIMEOUT:
                        failures += 1
                        self.health.count_error("nvmlEventSetWait")
                        self.health.log_once(("xid", "wait", error_code(exc)), logging.WARNING,
                                             "waiting for XID events failed: %s", error_text(exc))
                        self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)))  # back off, stay responsive
                        self.store.finish_round(NAME, time.monotonic() - started, False)
                        continue
                    data = None
                failures = 0
                if data is not None:
                    self.record(data)
                self.publish()
                self.store.finish_round(NAME, time.monotonic() - started, True)
        finally:
            self._free(event_set)

    def record(self, data: Any) -> None:
        """Count one event from ``nvmlEventSetWait`` (only XID events are registered)."""
        if not data.eventType & self.nv.nvmlEventTypeXidCriticalError:
            return
        device = self.by_key.get(handle_key(data.device))
        gpu = device.label if device is not None else "unknown"
        xid = int(data.eventData)
        key = (gpu, xid)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last[key] = self.clock()
        gi = getattr(data, "gpuInstanceId", INVALID_ID)
        self.health.log_once(("xid-event", gpu, xid), logging.WARNING,
                             "gpu %s: XID %d%s (further XID %d events are counted, not logged)",
                             gpu, xid, f" in GPU instance {gi}" if gi != INVALID_ID else "", xid)

    def publish(self) -> None:
        per_gpu: dict[str, list[Sample]] = {d.label: [] for d in self.devices}
        for (gpu, xid), n in self.counts.items():
            per_gpu.setdefault(gpu, []).append(Sample(cat.GPU_XID_ERRORS, (gpu, str(xid)), float(n)))
        for (gpu, xid), at in self.last.items():
            per_gpu.setdefault(gpu, []).append(Sample(cat.GPU_XID_LAST, (gpu, str(xid)), at))
        for gpu, samples in per_gpu.items():
            if not self.health.is_lost(gpu):
                self.store.publish(NAME, gpu, samples)
