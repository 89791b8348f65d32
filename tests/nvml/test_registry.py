"""Collectors register themselves; the flags and the exporter read one table."""

import pytest

from gpuscope.nvml.calls import Calls
from gpuscope.nvml.collector_table import registered
from gpuscope.nvml.collectors import Collector
from gpuscope.nvml.config import Config, parse
from gpuscope.nvml.health import Health
from gpuscope.nvml.registry import register_collector
from tests.nvml.fake_nvml import FakeNvml


def test_every_registration_has_its_flag_and_default():
    table = registered()
    assert {"device", "clock_events", "energy", "processes", "xid"} <= set(table)
    defaults = parse([]).collectors
    assert defaults == {name for name, r in table.items() if r.default}
    everything = parse([f"--collector.{name}" for name in table]).collectors
    assert everything == set(table)
    assert parse(["--no-collector.device"]).collectors == defaults - {"device"}


def test_every_sampling_collector_builds_from_a_config():
    calls = Calls(FakeNvml(), Health())
    config = Config(interval=2.0, processes_max=7)
    for name, registration in registered().items():
        if not issubclass(registration.cls, Collector):
            continue  # the XID watcher runs its own thread
        collector = registration.cls.build(calls, config, "/proc")
        assert collector.name == name
    assert registered()["clock_events"].cls.build(calls, config, "/proc").max_gap == 5.0
    assert registered()["processes"].cls.build(calls, config, "/proc").max_processes == 7


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        register_collector("device", default=True, help="again")(type("Again", (), {}))
