"""Every GPU through the NVML exporter's own code (``gpuscope.nvml``): the same calls, error policy,
throttle reasons, XID watcher and per-process records (pid, memory, SM utilization where the driver
keeps per-process samples) as ``gpuscope exporter``, run in-process and read from its registry.

``GpuSampler(nv=fake)`` runs on the tests' fake NVML exactly as on libnvidia-ml.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.config import Config
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.xid import NAME as XID

#: What a reading keeps, per GPU label: metric name → {reason, XID code or pid, else "": value}.
Reading = dict[str, dict[str, dict[str, float]]]
_WANTED = {m.name: m for m in (
    cat.GPU_UTILIZATION, cat.GPU_MEMORY_USED, cat.GPU_MEMORY_TOTAL, cat.GPU_SM_CLOCK, cat.GPU_POWER,
    cat.GPU_POWER_LIMIT, cat.GPU_CLOCK_EVENT_ACTIVE, cat.GPU_XID_ERRORS, cat.GPU_ENERGY,
    cat.GPU_PROCESS_MEMORY, cat.GPU_PROCESS_SM_UTILIZATION)}
#: The exporter caps per-process series (its --processes.max); a diagnosis wants every holder.
_MAX_PROCESSES = 1024


class GpuSampler:
    """Starts an in-process exporter sampling at ``interval``; :meth:`read` returns its latest values."""

    def __init__(self, interval: float = 0.5, nv: Any = None, xid_wait_ms: int = 200) -> None:
        # Processes are a slow collector (its NVML calls cost more): one round a second at most.
        config = Config(interval=interval, slow_interval=max(interval, 1.0), processes_max=_MAX_PROCESSES,
                        collectors=frozenset({"device", "clock_events", "energy", "processes", XID}))
        self.exporter = Exporter(config, nv=nv, xid_wait_ms=xid_wait_ms)

    def start(self) -> GpuSampler:
        self.exporter.start()
        return self

    @property
    def available(self) -> bool:
        return self.exporter.nvml_ok and bool(self.exporter.devices)

    def read(self) -> Reading:
        out: Reading = defaultdict(lambda: defaultdict(dict))
        for family in self.exporter.registry.collect():
            for s in family.samples:
                if s.name not in _WANTED or "gpu" not in s.labels:
                    continue
                key = s.labels.get("reason") or s.labels.get("xid") or s.labels.get("pid") or ""
                out[s.labels["gpu"]][s.name][key] = s.value
        return out

    def stop(self) -> None:
        self.exporter.stop()
