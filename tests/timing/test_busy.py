"""The kernel busy window: ratios per op, its schedule within the budget, and its failures.

CUPTI cannot run without a GPU, so these tests trace with ``FakeTrace``, which returns chosen
kernel nanoseconds per external id; the parsing of CUPTI's own records is tested against record
objects with cupti-python's attribute names (checked against the installed package where it is).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from gpuscope.timing import busy as busy_module
from gpuscope.timing.busy import kernel_ns_by_external_id
from gpuscope.timing.routes import HostRoute
from tests.conftest import wait_for
from tests.timing.conftest import prepared

KERNEL, CORRELATION = 10, 39  # CUPTI's ActivityKind values for CONCURRENT_KERNEL, EXTERNAL_CORRELATION


class FakeClockRoute(HostRoute):
    """Events stamp ``now``, which only the test's modules advance: a module's region time is
    exactly what its forward adds, and an empty calibration pair reads 0."""

    name = "fake-clock"

    def __init__(self) -> None:
        self.now = 0.0
        self.ready = True

    def create(self) -> list[float]:
        return [0.0]

    def record(self, event: list[float], stream: int) -> int:
        event[0] = self.now
        return 0

    def query(self, event: list[float]) -> bool:
        return self.ready

    def elapsed_s(self, start: list[float], end: list[float]) -> float:
        return end[0] - start[0]


class Work(torch.nn.Module):
    """A module whose "GPU time" is ``seconds`` on the fake clock."""

    def __init__(self, route: FakeClockRoute, seconds: float) -> None:
        super().__init__()
        self.route, self.seconds = route, seconds

    def forward(self, x):
        self.route.now += self.seconds
        return x + 1


class Model(torch.nn.Module):
    def __init__(self, route: FakeClockRoute) -> None:
        super().__init__()
        self.attn = Work(route, 4e-3)
        self.mlp = Work(route, 2e-3)

    def forward(self, x):
        return self.mlp(self.attn(x))


class FakeTrace:
    """A kernel tracer that reports ``busy_ns`` per external id and logs what it was asked."""

    def __init__(self, busy_ns: dict[int, int], fail_start: bool = False) -> None:
        self.busy_ns = busy_ns
        self.fail_start = fail_start
        self.calls: list[tuple] = []
        self.stopped_on: list[str] = []  # the thread of each stop()

    def start(self) -> None:
        self.calls.append(("start",))
        if self.fail_start:
            raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")

    def push(self, external_id: int) -> None:
        self.calls.append(("push", external_id))

    def pop(self) -> None:
        self.calls.append(("pop",))

    def stop_launches(self) -> None:
        self.calls.append(("stop_launches",))

    def stop(self) -> dict[int, int]:
        self.calls.append(("stop",))
        self.stopped_on.append(threading.current_thread().name)
        return dict(self.busy_ns)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def busy_timer(make_timer, trace: FakeTrace, clock: Clock, **options):
    route = FakeClockRoute()
    timer = prepared(make_timer(route=route, sample_rate=1.0))
    busy = timer.enable_kernel_busy(trace, clock=clock, **options)
    model = Model(route)
    inst = timer.instrument(model, include=("attn", "mlp"))
    return timer, busy, model, inst, route


def ratio(registry, op):
    return registry.get_sample_value("gpuscope_region_gpu_busy_ratio", {"op": op, "device": "cpu"})


def test_a_window_divides_each_modules_kernel_time_by_its_region_time(make_timer, registry):
    trace = FakeTrace({0: 1_000_000, 1: 3_000_000})  # attn: 1 of 4 ms; mlp: 3 ms "in" 2 ms
    timer, busy, model, _inst, _ = busy_timer(make_timer, trace, Clock())
    model(torch.zeros(2))
    assert timer.flush(5)
    assert busy.windows["ok"] == 1
    assert ratio(registry, "attn") == pytest.approx(0.25)
    assert ratio(registry, "mlp") == 1.0  # other streams' kernels can exceed the region: capped
    # Each module ran under its own correlation id, and tracing stopped once the regions completed.
    assert trace.calls == [("start",), ("push", 0), ("pop",), ("push", 1), ("pop",), ("stop_launches",),
                           ("stop",)]
    # The traced pass's regions are ordinary samples too.
    counts = [registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": "cpu"})
              for op in ("attn", "mlp")]
    assert counts == [1, 1]


def test_the_next_window_waits_the_minimum_interval_or_longer_when_it_costs_more(make_timer):
    clock = Clock()
    trace = FakeTrace({0: 1, 1: 1})
    timer, busy, model, _inst, _ = busy_timer(make_timer, trace, clock, min_interval_s=10.0, budget_share=1.0)
    model(torch.zeros(2))
    assert timer.flush(5) and busy.windows["ok"] == 1
    clock.t += 9.0
    model(torch.zeros(2))
    assert busy.windows["ok"] == 1, "a window within min_interval_s"
    clock.t += 2.0
    model(torch.zeros(2))
    assert timer.flush(5) and busy.windows["ok"] == 2
    # A window that cost 1 s of CPU fits the (fallback) 1% budget only once every 100 s.
    busy._schedule(1.0)
    assert busy.interval_s >= 100.0
    clock.t += 99.0
    assert not busy.due()
    clock.t += 51.0
    assert busy.due()


def test_a_window_whose_regions_never_complete_is_given_up_and_counted(make_timer):
    clock = Clock()
    trace = FakeTrace({0: 1, 1: 1})
    timer, busy, model, _inst, route = busy_timer(make_timer, trace, clock, min_interval_s=0.0)
    route.ready = False  # the GPU never reaches the events
    model(torch.zeros(2))
    assert not busy.due()  # the window is still open
    clock.t += busy_module.WINDOW_TIMEOUT_S + 1
    assert not busy.due()  # the inference thread never gives it up: stopping CUPTI flushes buffers
    wait_for(lambda: busy.windows["timeout"] == 1, timeout=10, what="the resolver to give the window up")
    assert busy.windows == {"ok": 0, "timeout": 1, "failed": 0}
    assert trace.calls[-1] == ("stop",), "...and stops tracing"
    assert trace.stopped_on[-1] == "gpuscope-timing-resolver"
    route.ready = True
    assert timer.flush(5)  # the late regions find no window: nothing breaks
    clock.t += 1000.0
    assert busy.due()


def test_a_tracer_that_cannot_start_costs_a_count_not_the_pass(make_timer, registry):
    trace = FakeTrace({}, fail_start=True)
    timer, busy, model, _inst, _ = busy_timer(make_timer, trace, Clock())
    out = model(torch.zeros(2))
    assert torch.equal(out, torch.full((2,), 2.0))
    assert timer.flush(5)
    assert busy.windows["failed"] == 1
    assert registry.get_sample_value("gpuscope_timer_kernel_busy_windows_total",
                                     {"outcome": "failed"}) == 1
    labels = {"op": "attn", "device": "cpu"}
    assert registry.get_sample_value("gpuscope_region_gpu_seconds_count", labels) == 1


def test_off_by_default(make_timer, registry):
    timer = make_timer(sample_rate=1.0)
    assert timer.core.busy is None
    with timer.region("op"):
        pass
    assert timer.flush(5)
    assert ratio(registry, "op") is None
    assert registry.get_sample_value("gpuscope_timer_kernel_busy_windows_total", {"outcome": "ok"}) is None


def records(*rows):
    """Records shaped as cupti-python delivers them (its ActivityKernel* and ActivityExternalCorrelation
    classes: kind, correlation_id, start, end / external_id)."""
    out = []
    for row in rows:
        if row[0] == "kernel":
            _, correlation_id, start, end = row
            out.append(SimpleNamespace(kind=KERNEL, correlation_id=correlation_id, start=start, end=end))
        else:
            _, correlation_id, external_id = row
            out.append(SimpleNamespace(kind=CORRELATION, correlation_id=correlation_id,
                                       external_id=external_id))
    return out


def test_kernel_time_is_summed_per_external_id_in_any_record_order():
    recs = records(("kernel", 7, 100, 400), ("corr", 7, 0), ("kernel", 8, 500, 550), ("corr", 8, 1),
                   ("kernel", 9, 600, 700), ("corr", 9, 1), ("kernel", 99, 0, 10_000))  # 99: not ours
    assert kernel_ns_by_external_id(recs, KERNEL, CORRELATION) == {0: 300, 1: 150}


def test_cupti_python_records_have_the_attributes_the_parser_reads():
    cupti = pytest.importorskip("cupti.cupti", reason="cupti-python is not installed")
    assert int(cupti.ActivityKind.CONCURRENT_KERNEL) == KERNEL
    assert int(cupti.ActivityKind.EXTERNAL_CORRELATION) == CORRELATION
    for name in ("kind", "correlation_id", "start", "end"):
        assert hasattr(cupti.ActivityKernel11, name)
    for name in ("kind", "correlation_id", "external_id"):
        assert hasattr(cupti.ActivityExternalCorrelation, name)


def test_the_ratio_divides_by_the_ops_ordinary_region_time_not_the_traced_passs(make_timer, registry):
    """Tracing slows launches, so the traced pass's own region reads long: the window divides by
    the mean of the op's untraced samples since the last window."""
    clock = Clock()
    trace = FakeTrace({0: 1_000_000, 1: 1_000_000})
    timer, busy, model, _, _ = busy_timer(make_timer, trace, clock, min_interval_s=10.0)
    model(torch.zeros(2))  # window 1: attn 4 ms, mlp 2 ms (no ordinary samples yet)
    assert timer.flush(5) and busy.windows["ok"] == 1
    model.attn.seconds, model.mlp.seconds = 2e-3, 1e-3  # ordinary passes: attn 2 ms, mlp 1 ms
    for _ in range(3):
        model(torch.zeros(2))
    clock.t += 11.0
    model.attn.seconds, model.mlp.seconds = 8e-3, 8e-3  # the traced pass reads long
    model(torch.zeros(2))
    assert timer.flush(5) and busy.windows["ok"] == 2
    assert ratio(registry, "attn") == pytest.approx(0.5)  # 1 ms of kernels in a usual 2 ms
    assert ratio(registry, "mlp") == pytest.approx(1.0)
