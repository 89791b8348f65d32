"""Custom Prometheus collectors describe their families, so a registry refuses a name registered twice.

prometheus_client checks a collector's names against the registry's others when it is registered,
from its ``describe()``; a collector that describes nothing passes, and two of them with one name
both serve it: a scrape with a family twice, which Prometheus rejects whole. Each collector here
describes what its ``collect()`` yields, from the catalogue, without reading live state.
"""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.config import COLLECTORS, Config
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.exposition import ExporterCollector, StalenessCollector
from gpuscope.nvml.health import Health
from gpuscope.nvml.store import Store
from gpuscope.timing import Timer
from gpuscope.timing.collector import TimerCollector
from tests.conftest import wait_for
from tests.nvml.fake_nvml import FakeGpu, FakeNvml

DUPLICATE = "Duplicated timeseries"


def names(families) -> set[str]:
    return {f.name for f in families}


def exporter_state() -> ExporterCollector:
    return ExporterCollector(Store(), Health(), [])


def test_describe_reads_no_state() -> None:
    # No timer behind it: describe() answers from the catalogue alone.
    timer = TimerCollector(None, None, None)  # type: ignore[arg-type]
    assert {cat.REGION_GPU_SECONDS.name, cat.TIMER_BACKEND.base_name} <= names(timer.describe())
    assert cat.GPU_INFO.base_name in names(exporter_state().describe())
    assert names(StalenessCollector(Store()).describe()) == {cat.EXPORTER_STALENESS.name}


def test_a_timer_collector_registers_once_per_registry() -> None:
    registry = CollectorRegistry()
    with Timer(registry, backend="host") as timer:
        with pytest.raises(ValueError, match=DUPLICATE):
            registry.register(TimerCollector(timer.core, timer.resolver, timer.budget_controller))
        with pytest.raises(ValueError, match=DUPLICATE):
            Timer(registry, backend="host")  # a second timer would serve the same families
        with pytest.raises(ValueError, match=DUPLICATE):
            cat.REGIONS_ENTERED.create(registry)  # another collector with one of its names


def test_a_closed_timer_gives_its_names_back() -> None:
    registry = CollectorRegistry()
    Timer(registry, backend="host").close()
    with Timer(registry, backend="host") as timer:  # a notebook cell run again, after a close
        assert not timer.closed


def test_an_exporter_collector_registers_once_per_registry() -> None:
    registry = CollectorRegistry()
    state = exporter_state()
    registry.register(state)
    registry.register(StalenessCollector(Store()))  # the age of the values is its own family
    with pytest.raises(ValueError, match=DUPLICATE):
        registry.register(state)
    with pytest.raises(ValueError, match=DUPLICATE):
        registry.register(exporter_state())
    with pytest.raises(ValueError, match=DUPLICATE):
        cat.GPU_MEMORY_USED.create(registry)
    with pytest.raises(ValueError, match=DUPLICATE):
        registry.register(StalenessCollector(Store()))


def test_the_timer_describes_every_family_it_collects() -> None:
    with Timer(None, backend="host", sample_rate=1.0) as timer:
        with timer.region("op"):
            pass
        wait_for(lambda: timer.core.pending() == 0, what="the region resolved")
        collector = TimerCollector(timer.core, timer.resolver, timer.budget_controller)
        assert names(collector.collect()) <= names(collector.describe())


def test_the_exporter_describes_every_family_it_collects() -> None:
    config = dataclasses.replace(Config(interval=0.05, slow_interval=0.1, call_timeout=2.0),
                                 collectors=frozenset(COLLECTORS))
    exporter = Exporter(config, nv=FakeNvml([FakeGpu(), FakeGpu()]), xid_wait_ms=50).start()
    try:
        state = ExporterCollector(exporter.store, exporter.health, exporter.devices, exporter.driver_version)
        wait_for(lambda: {cat.GPU_UTILIZATION.name, cat.GPU_ENERGY.base_name} <= names(state.collect()),
                 what="the fast and the slow collectors' rounds")
        assert names(state.collect()) <= names(state.describe())
    finally:
        exporter.stop()
