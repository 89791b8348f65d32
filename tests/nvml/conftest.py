"""Fixtures for the NVML exporter tests: a fake NVML and exporters running on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from gpuscope.nvml.config import Config
from gpuscope.nvml.exporter import Exporter
from tests.nvml.fake_nvml import FakeNvml

#: Short cadences so rounds happen often; every wait in the tests is a deadline, never a sleep.
#: The call timeout stays generous (a loaded 2-core CI box can stall a thread for a while);
#: tests of hung calls set their own.
FAST = Config(interval=0.05, slow_interval=0.1, call_timeout=2.0)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def start_exporter() -> Iterator[Callable[..., Exporter]]:
    """``start_exporter(fake, **config_overrides)`` → a started Exporter, stopped at teardown."""
    started: list[Exporter] = []

    def start(nv: FakeNvml, proc_root: str = "/proc", **overrides) -> Exporter:
        config = dataclasses.replace(FAST, **overrides)
        exporter = Exporter(config, nv=nv, proc_root=proc_root, xid_wait_ms=50).start()
        started.append(exporter)
        return exporter

    yield start
    for exporter in started:
        # Release any fake call a test left hung, so lanes can finish.
        for gpu in getattr(exporter.nv, "gpus", []):
            for event in gpu.hangs.values():
                event.set()
        exporter.stop()


def wait_first_rounds(exporter: Exporter) -> None:
    """Until every running collector has finished a round."""
    from tests.conftest import wait_for

    for sampler in exporter.samplers:
        name = sampler.collector.name
        wait_for(lambda n=name: (value(exporter, "gpuscope_exporter_last_success_timestamp_seconds",
                                       collector=n) or 0) > 0, what=f"first {name} round")


def value(exporter: Exporter, name: str, /, **labels: str) -> float | None:
    """One sample from a scrape of ``exporter`` (None when absent)."""
    return exporter.registry.get_sample_value(name, labels)
