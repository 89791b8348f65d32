"""Fakes for the timer's tests: a route whose clock the test controls."""

from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry

from gpuscope.timing import Timer, hot
from gpuscope.timing.routes import HostRoute


class ScriptedRoute(HostRoute):
    """Host-like route whose "GPU clock" advances by ``step`` seconds at every record.

    Lets a test state exactly what each event pair measures, so baseline subtraction and
    histogram placement are checked against known values. ``ready`` gates completion.
    """

    name = "scripted"

    def __init__(self, step: float = 1e-6) -> None:
        self.step = step
        self.clock = 0.0
        self.ready = True
        self.records = 0
        self.created: list[list[float]] = []
        self.destroyed = 0

    def create(self) -> list[float]:
        event = [0.0]
        self.created.append(event)
        return event

    def record(self, event: list[float], stream: int) -> int:
        self.clock += self.step
        event[0] = self.clock
        self.records += 1
        return 0

    def query(self, event: list[float]) -> bool:
        return self.ready

    def elapsed_s(self, start: list[float], end: list[float]) -> float:
        return end[0] - start[0]

    def destroy(self, event: list[float]) -> None:
        self.destroyed += 1


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def require_native() -> None:
    """Skip a test of the C extension where it is not built; with GPUSCOPE_STRICT=1, fail it."""
    if not hot.native_available():
        if os.environ.get("GPUSCOPE_STRICT") == "1":
            pytest.fail("the C hot path is not built (a C compiler and Python headers are needed)")
        pytest.skip("the C hot path is not built")


@pytest.fixture(params=["native", "python"])
def hot_path(request) -> bool:
    """Each timer test runs on both hot paths: the C extension and the Python fallback."""
    native = request.param == "native"
    if native:
        require_native()
    return native


@pytest.fixture
def make_timer(registry, hot_path):
    timers: list[Timer] = []

    def make(**kwargs) -> Timer:
        kwargs.setdefault("backend", "host")
        kwargs.setdefault("native", hot_path)
        timer = Timer(registry if "registry" not in kwargs else kwargs.pop("registry"), **kwargs)
        timers.append(timer)
        return timer

    yield make
    for timer in timers:
        timer.close(timeout=1.0)


def prepared(timer: Timer) -> Timer:
    """The timer with the current device's pool made and its baseline calibrated, as after a first
    region: a test that counts records must not count the calibration's."""
    timer.core.add_device(timer.core.current_device())
    assert timer.flush(5)
    return timer


def time_regions(timer: Timer, exact: int = 3, passes: int = 2) -> None:
    """``exact`` regions of op "exact", then ``passes`` sequence passes over "first" and "second"."""
    for _ in range(exact):
        with timer.region("exact"):
            pass
    seq = timer.sequence()
    for _ in range(passes):
        seq.begin()
        seq.split("first")
        seq.split("second")
        seq.end()
