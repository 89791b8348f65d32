"""Every GPU through the NVML exporter's own code (``gpuscope.nvml``): the same calls, error policy,
throttle reasons and XID watcher as ``gpuscope exporter``, run in-process and read from its registry.

``GpuSampler(nv=fake)`` runs on the tests' fake NVML exactly as on libnvidia-ml.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.config import Config
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.xid import NAME as XID

#: What a reading keeps, per GPU label: metric name → {label value of the second label or "": value}.
Reading = dict[str, dict[str, dict[str, float]]]
_WANTED = {m.name: m for m in (
    cat.GPU_UTILIZATION, cat.GPU_MEMORY_USED, cat.GPU_MEMORY_TOTAL, cat.GPU_SM_CLOCK, cat.GPU_POWER,
    cat.GPU_POWER_LIMIT, cat.GPU_CLOCK_EVENT_ACTIVE, cat.GPU_XID_ERRORS, cat.GPU_ENERGY)}


class GpuSampler:
    """Starts an in-process exporter sampling at ``interval``; :meth:`read` returns its latest values."""

    def __init__(self, interval: float = 0.5, nv: Any = None, xid_wait_ms: int = 200) -> None:
        config = Config(interval=interval, slow_interval=max(interval, 1.0),
                        collectors=frozenset({"device", "clock_events", "energy", XID}))
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
                key = s.labels.get("reason") or s.labels.get("xid") or ""
                out[s.labels["gpu"]][s.name][key] = s.value
        return out

    def stop(self) -> None:
        self.exporter.stop()
