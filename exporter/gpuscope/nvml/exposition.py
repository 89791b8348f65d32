"""The scrape: a prometheus_client collector that turns the cached store into metric families.

Nothing here calls NVML; a scrape reads a snapshot of the store, so its cost depends on the
number of series, not on how slow NVML is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.metrics_core import Metric as Family

from gpuscope import catalogue as cat
from gpuscope.nvml.devices import Device
from gpuscope.nvml.health import Health
from gpuscope.nvml.store import Store

#: The collector whose answer decides ``gpuscope_exporter_gpu_up``.
UP_COLLECTOR = "device"


class ExporterCollector:
    """Yields every ``gpuscope_gpu_*`` and ``gpuscope_exporter_*`` family from cached state."""

    def __init__(self, store: Store, health: Health, devices: Sequence[Device], driver_version: str = "",
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.health = health
        self.devices = list(devices)
        self.driver_version = driver_version
        self.clock = clock

    def describe(self) -> list:
        return []  # names vary with hardware; registration must not run a collection

    def collect(self) -> Iterator[Family]:
        now = self.clock()
        snapshot = self.store.snapshot()
        families: dict[str, Family] = {}

        def add(metric: cat.Metric, labels: Sequence[str], value: float) -> None:
            family = families.get(metric.name)
            if family is None:
                family = families[metric.name] = metric.family()
            family.add_metric(list(labels), value)

        info = cat.GPU_INFO.family()
        for d in self.devices:
            info.add_metric([d.label, d.uuid, d.name, d.pci_bus_id, self.driver_version, d.mig_parent], {})
        if self.devices:
            yield info

        for state in snapshot.values():
            for gpu, data in state.devices.items():
                if self.health.is_lost(gpu):
                    continue
                for sample in data.samples:
                    add(sample.metric, sample.labels, sample.value)

        add(cat.EXPORTER_GPUS, (), float(len(self.devices)))
        add(cat.EXPORTER_GPUS_LOST, (), float(self.health.lost_count()))
        up_state = snapshot.get(UP_COLLECTOR)
        for d in self.devices:
            up = not self.health.is_lost(d.label)
            if up and up_state is not None and d.label in up_state.devices:
                up = up_state.devices[d.label].up
            add(cat.EXPORTER_GPU_UP, (d.label,), 1.0 if up else 0.0)
            for call in sorted(d.unsupported.copy()):  # copy: lanes may add meanwhile
                add(cat.EXPORTER_UNSUPPORTED, (d.label, call), 1.0)
        for name, state in sorted(snapshot.items()):
            add(cat.EXPORTER_COLLECTION_SECONDS, (name,), state.duration)
            add(cat.EXPORTER_LAST_SUCCESS, (name,), state.last_success)
            add(cat.EXPORTER_STALENESS, (name,), self.store.staleness(state, now))
        for call, n in sorted(self.health.errors().items()):
            add(cat.EXPORTER_ERRORS, (call,), float(n))
        yield from families.values()
