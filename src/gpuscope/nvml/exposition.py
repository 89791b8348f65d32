"""The store as metric families: prometheus_client collectors over cached state.

Nothing here calls NVML. ``ExporterCollector`` yields what changes only when samplers publish
(rendered in the background, see ``rendered.py``); ``StalenessCollector`` yields the age of the
values served, which grows between rounds and is rendered on every scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.metrics_core import Metric as Family

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.devices import Device
from gpuscope.nvml.health import Health
from gpuscope.nvml.store import CollectorState, Store

#: The collector whose answer decides ``gpuscope_exporter_gpu_up``.
UP_COLLECTOR = "device"

#: Every family ``ExporterCollector`` may yield (which ones it does depends on the GPUs and the
#: collectors that run): the exporter's catalogue metrics but the ones served by others, the age of
#: the values (``StalenessCollector``) and the HTTP server's closed connections.
METRICS = tuple(m for m in cat.all_metrics() if m.area == cat.GPU
                and m not in (cat.EXPORTER_STALENESS, cat.EXPORTER_HTTP_CONNECTIONS_CLOSED))


class ExporterCollector:
    """Yields every ``gpuscope_gpu_*`` and ``gpuscope_exporter_*`` family from cached state."""

    def __init__(self, store: Store, health: Health, devices: Sequence[Device],
                 driver_version: str = "") -> None:
        self.store = store
        self.health = health
        self.devices = list(devices)
        self.driver_version = driver_version

    def describe(self) -> list[Family]:
        """Every family it may yield, from the catalogue: registration checks the names without
        running a collection."""
        return [metric.family() for metric in METRICS]

    def collect(self) -> Iterator[Family]:
        yield from self.families(self.store.snapshot())

    def families(self, snapshot: dict[str, CollectorState]) -> Iterator[Family]:
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
        for call, n in sorted(self.health.errors().items()):
            add(cat.EXPORTER_ERRORS, (call,), float(n))
        yield from families.values()


class PinnedSnapshot:
    """The exporter's families rendered from one store snapshot, which it keeps: the staleness
    served beside a cached rendering must be the age of *those* values, not of newer ones."""

    def __init__(self, collector: ExporterCollector) -> None:
        self.collector = collector
        self.snapshot: dict[str, CollectorState] | None = None

    def collect(self) -> Iterator[Family]:
        snapshot = self.collector.store.snapshot()
        yield from self.collector.families(snapshot)
        self.snapshot = snapshot

    def served(self) -> dict[str, CollectorState]:
        return self.snapshot if self.snapshot is not None else self.collector.store.snapshot()


class StalenessCollector:
    """``gpuscope_exporter_staleness_seconds{collector}``: one series per collector, read now.

    ``snapshot`` gives the state whose age is reported (default: the store's current state)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time,
                 snapshot: Callable[[], dict[str, CollectorState]] | None = None) -> None:
        self.store = store
        self.clock = clock
        self.snapshot = snapshot or store.snapshot

    def describe(self) -> list[Family]:
        return [cat.EXPORTER_STALENESS.family()]

    def collect(self) -> Iterator[Family]:
        now = self.clock()
        family = cat.EXPORTER_STALENESS.family()
        for name, state in sorted(self.snapshot().items()):
            family.add_metric([name], self.store.staleness(state, now))
        yield family
