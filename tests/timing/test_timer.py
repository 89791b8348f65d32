import ctypes
import logging
import threading
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from gpuscope.timing import Timer, capture, hot, trace
from gpuscope.timing.routes import HostRoute
from tests.conftest import promtool_check_metrics, wait_for
from tests.timing.conftest import ScriptedRoute, prepared


class SlowRoute(ScriptedRoute):
    """Records that cost 50 µs each: far over a 1% budget at any busy rate."""

    def record(self, event, stream):
        end = time.perf_counter() + 50e-6
        while time.perf_counter() < end:
            pass
        return super().record(event, stream)


def sample_count(registry, op, device="cpu"):
    return registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": device}) or 0


def test_region_times_host_work_into_the_right_bucket(make_timer, registry):
    timer = make_timer(sample_rate=1.0)
    for _ in range(3):
        with timer.region("sleepy"):
            time.sleep(0.012)  # the workload being timed, not a wait for the timer
    assert timer.flush(5)
    assert sample_count(registry, "sleepy") == 3
    le_10ms = registry.get_sample_value("gpuscope_region_gpu_seconds_bucket",
                                        {"op": "sleepy", "device": "cpu", "le": "0.01"})
    le_25ms = registry.get_sample_value("gpuscope_region_gpu_seconds_bucket",
                                        {"op": "sleepy", "device": "cpu", "le": "0.025"})
    assert (le_10ms, le_25ms) == (0, 3)
    total = registry.get_sample_value("gpuscope_region_gpu_seconds_sum", {"op": "sleepy", "device": "cpu"})
    assert 0.036 <= total < 0.2


def test_decorator_and_handles_time_and_callback_gets_seconds(make_timer, registry):
    timer = make_timer(sample_rate=1.0)

    @timer.region("decorated")
    def work(x):
        return x * 2

    assert work(21) == 42
    got = []
    handle = timer.start("explicit", on_elapsed=got.append)
    time.sleep(0.005)  # the workload being timed
    timer.stop(handle)
    timer.stop(handle)  # a second stop is a no-op
    assert timer.flush(5)
    assert sample_count(registry, "decorated") == 1
    assert len(got) == 1 and 0.004 < got[0] < 0.5


def test_baseline_is_subtracted_and_exported(registry):
    route = ScriptedRoute(step=2e-6)  # calibration pairs measure exactly 2 µs
    timer = Timer(registry, route=route, sample_rate=1.0, calibrate_every=0)
    try:
        # A device is calibrated where it is first used, before any of its samples is resolved.
        assert registry.get_sample_value("gpuscope_timer_baseline_seconds", {"device": "cpu"}) is None
        got = []
        handle = timer.start("op", on_elapsed=got.append)
        route.clock += 0.5  # the region's "GPU work"
        timer.stop(handle)
        assert timer.flush(5)
        assert registry.get_sample_value("gpuscope_timer_baseline_seconds", {"device": "cpu"}) == \
            pytest.approx(2e-6)
        assert got == [pytest.approx(0.5, abs=1e-9)]  # 0.5 s + 2 µs record gap − 2 µs baseline
    finally:
        timer.close()


def test_fixed_sampling_rate_times_one_in_four_and_counts_all(make_timer, registry):
    timer = make_timer(sample_rate=0.25)
    for _ in range(400):
        with timer.region("op"):
            pass
    assert timer.flush(5)
    assert registry.get_sample_value("gpuscope_regions_entered_total", {"op": "op"}) == 400
    assert sample_count(registry, "op") == 100
    assert registry.get_sample_value("gpuscope_timer_sampling_ratio", {"op": "op"}) == 0.25


def test_full_ring_drops_and_counts_without_blocking(make_timer, registry):
    timer = make_timer(sample_rate=1.0, ring_size=4, resolve_interval=30.0)
    t0 = time.perf_counter()
    for _ in range(10):
        with timer.region("op"):
            pass
    assert time.perf_counter() - t0 < 0.5
    assert registry.get_sample_value("gpuscope_timer_dropped_samples_total", {"reason": "ring_full"}) == 6
    assert registry.get_sample_value("gpuscope_timer_pending_samples") == 4
    assert timer.flush(5)
    assert sample_count(registry, "op") == 4


def test_empty_pool_drops_and_counts(make_timer, registry):
    route = ScriptedRoute()
    route.ready = False  # nothing completes, so no event comes back to the pool
    timer = make_timer(route=route, sample_rate=1.0, pool_size=6, resolve_interval=30.0)
    for _ in range(5):
        with timer.region("op"):
            pass
    assert registry.get_sample_value("gpuscope_timer_dropped_samples_total", {"reason": "pool_empty"}) == 2
    route.ready = True
    assert timer.flush(5)
    assert sample_count(registry, "op") == 3


def test_budget_mode_lowers_sampling_when_records_are_expensive(make_timer, registry):
    timer = make_timer(route=SlowRoute(), budget=0.01, resolve_interval=0.02)
    deadline = time.monotonic() + 20
    while timer.sampling_period() < 32 and time.monotonic() < deadline:
        for _ in range(200):
            with timer.region("op"):
                pass
    assert timer.sampling_period() >= 32, f"sampling period stayed at {timer.sampling_period()}"
    assert registry.get_sample_value("gpuscope_timer_sampling_ratio", {"op": "op"}) <= 1 / 32
    assert registry.get_sample_value("gpuscope_timer_hot_path_seconds") > 50e-6


def test_exemplars_carry_the_active_trace_id(make_timer, registry):
    timer = make_timer(sample_rate=1.0)
    with trace("4bf92f3577b34da6a3ce929d0e0e4736"), timer.region("op"):
        pass
    assert timer.flush(5)
    text = generate_openmetrics(registry).decode()
    assert '# {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"}' in text


class CapturingRoute(HostRoute):
    """The current stream is capturing a CUDA graph."""

    def is_capturing(self) -> bool:
        return True


@pytest.fixture
def capture_in_progress():
    """A CUDA graph capture is in progress somewhere in the process."""
    capture.in_progress[0] += 1
    yield
    capture.in_progress[0] -= 1


def test_graph_capture_skips_with_one_warning(make_timer, registry, caplog, capture_in_progress):
    timer = make_timer(sample_rate=1.0, route=CapturingRoute())
    with caplog.at_level(logging.WARNING, logger="gpuscope.timing"):
        for _ in range(3):
            with timer.region("captured"):
                pass
    assert registry.get_sample_value("gpuscope_timer_dropped_samples_total", {"reason": "graph_capture"}) == 3
    assert len([r for r in caplog.records if "graph capture" in r.message]) == 1


def test_threads_share_one_timer_without_losing_regions(make_timer, registry):
    timer = make_timer(sample_rate=1.0, ring_size=100_000, pool_size=100_000)

    def work():
        for _ in range(2000):
            with timer.region("op"), timer.region("inner"):
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert timer.flush(10)
    assert registry.get_sample_value("gpuscope_regions_entered_total", {"op": "op"}) == 8000
    assert sample_count(registry, "op") == 8000
    assert sample_count(registry, "inner") == 8000


def test_close_frees_every_event_and_later_regions_are_harmless(registry):
    route = ScriptedRoute()
    timer = Timer(registry, route=route, sample_rate=1.0, pool_size=8)
    with timer.region("op"):
        pass
    timer.close()
    assert route.destroyed >= 8
    with timer.region("op"):  # after close: nothing recorded, nothing raised
        pass
    assert not timer.resolver.running


def test_close_returns_within_timeout_when_gpu_never_finishes(registry):
    route = ScriptedRoute()
    route.ready = False
    timer = Timer(registry, route=route, sample_rate=1.0)
    with timer.region("op"):
        pass
    t0 = time.monotonic()
    timer.close(timeout=0.3)
    assert time.monotonic() - t0 < 2


def test_resolver_survives_a_failing_callback(make_timer, registry):
    timer = make_timer(sample_rate=1.0)

    def boom(seconds):
        raise RuntimeError("user bug")

    timer.stop(timer.start("op", on_elapsed=boom))
    assert timer.flush(5)
    assert timer.resolver.callback_errors == 1
    with timer.region("op"):
        pass
    assert timer.flush(5)
    assert sample_count(registry, "op") == 2


def test_sequence_shares_boundaries(make_timer, registry):
    route = ScriptedRoute()
    timer = prepared(make_timer(route=route, sample_rate=1.0))
    before = route.records
    seq = timer.sequence()
    with seq:
        for op in ("a", "b", "c"):
            seq.split(op)
    assert route.records - before == 4  # N + 1 records for N regions
    assert timer.flush(5)
    assert [sample_count(registry, op) for op in "abc"] == [1, 1, 1]
    assert len(timer.core.pools[0]) == timer.core.pool_size  # every event back in the pool


def test_exposition_passes_promtool(make_timer, registry):
    timer = make_timer(sample_rate=1.0)
    with trace("abc"), timer.region("op"):
        pass
    timer.flush(5)
    promtool_check_metrics(generate_latest(registry))


def test_bad_arguments_are_clear_errors(registry):
    with pytest.raises(ValueError, match="sample_rate"):
        Timer(registry, backend="host", sample_rate=2)
    with pytest.raises(ValueError, match="budget"):
        Timer(registry, backend="host", budget=0)
    with pytest.raises(ValueError, match="unknown timing backend"):
        Timer(registry, backend="quantum")


def test_resolver_lag_reported_while_gpu_is_behind(make_timer, registry):
    route = ScriptedRoute()
    timer = make_timer(route=route, sample_rate=1.0, resolve_interval=0.01)
    route.ready = False
    with timer.region("op"):
        pass
    wait_for(lambda: registry.get_sample_value("gpuscope_timer_resolver_lag_seconds") > 0.05, 5,
             what="resolver lag to grow")
    route.ready = True
    wait_for(lambda: registry.get_sample_value("gpuscope_timer_resolver_lag_seconds") == 0, 5,
             what="resolver lag to clear")


def test_budget_leaves_to_sampled_regions_only_what_always_timed_regions_do_not_spend(make_timer, registry):
    timer = make_timer(route=SlowRoute(), budget=0.01, resolve_interval=0.02)
    charged: list[float] = []
    deadline = time.monotonic() + 20
    # Each iteration: a step timed every time (on_elapsed, as the server charges tenants) whose two
    # records alone cost ~4% of the loop, and one region sampling may thin. Counting the step as
    # thinnable, the controller settled near period 9; it must see the budget already spent.
    while timer.sampling_period() < 256 and time.monotonic() < deadline:
        handle = timer.start("step", on_elapsed=charged.append)
        with timer.region("module"):
            pass
        time.sleep(0.002)  # the step's own work
        timer.stop(handle)
    assert timer.sampling_period() >= 256, f"sampling period stayed at {timer.sampling_period()}"
    assert timer.flush(5)
    assert len(charged) == timer.op_state("step").always  # every step still timed
    assert registry.get_sample_value("gpuscope_timer_overhead_ratio") > 0.01  # the excess is shown


RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
CUDA_ERROR_INVALID_RESOURCE_HANDLE = 400


class AddressRoute(HostRoute):
    """Integer event handles recorded through a C function pointer, as the cudart route offers
    cudaEventRecord's address; here the "C function" is a ctypes callback that stamps the time."""

    def __init__(self) -> None:
        self.stamps: dict[int, int] = {}
        self.streams: list[int] = []
        self.calls = 0  # through the function: the hot path's and record()'s
        self.python_calls = 0  # through record()
        self.failing = False
        self._next = 1000

        def record(event: int, stream: int | None) -> int:
            self.calls += 1
            if self.failing:
                return CUDA_ERROR_INVALID_RESOURCE_HANDLE
            self.stamps[event] = time.perf_counter_ns()
            self.streams.append(stream or 0)
            return 0

        self._callback = RECORD_FN(record)  # kept alive as long as the route
        self.record_address = ctypes.cast(self._callback, ctypes.c_void_p).value

    def current_stream(self, device: int) -> int:
        return 0x7F00

    def create(self) -> int:
        self._next += 1
        return self._next

    def record(self, event: int, stream: int) -> int:
        """Off the hot path (calibration, a sequence's last boundary): the same function, counted."""
        self.python_calls += 1
        return self._callback(event, stream)

    def elapsed_s(self, start: int, end: int) -> float:
        return (self.stamps[end] - self.stamps[start]) * 1e-9


def time_exact_and_shared_regions(timer: Timer) -> None:
    for _ in range(10):
        with timer.region("exact"):
            pass
    seq = timer.sequence()
    for _ in range(5):
        seq.begin()
        seq.split("first")
        seq.split("second")
        seq.end()


@pytest.mark.parametrize("failing", [False, True], ids=["records", "every-record-fails"])
def test_the_c_hot_path_records_through_the_routes_function_address(registry, failing):
    """Exact regions (two records each) and shared-boundary sequences (three records a pass) both
    record through the route's C function, on the current stream; failed records are counted and
    their regions dropped, never raised."""
    if not hot.native_available():
        pytest.skip("the C hot path is not built")
    route = AddressRoute()
    timer = prepared(Timer(registry, route=route, sample_rate=1.0, native=True))
    try:
        before, python_before, errors_before = route.calls, route.python_calls, timer.dropped["error"]
        route.failing = failing
        time_exact_and_shared_regions(timer)
        assert timer.flush(5)
    finally:
        timer.close(timeout=1.0)

    def samples(op: str) -> float:
        labels = {"op": op, "device": "cpu"}
        return registry.get_sample_value("gpuscope_region_gpu_seconds_count", labels) or 0

    if failing:
        # Each exact region fails at its start; each pass fails at both splits and has nothing to end.
        assert route.calls - before == 10 + 5 * 2
        assert route.python_calls == python_before
        assert timer.dropped["error"] - errors_before == 20
        assert samples("exact") == samples("first") == samples("second") == 0
    else:
        assert route.calls - before == 10 * 2 + 5 * 3
        assert route.python_calls - python_before == 5  # only each pass's end is recorded from Python
        assert set(route.streams[before:]) == {0x7F00}
        assert (samples("exact"), samples("first"), samples("second")) == (10, 5, 5)
        assert timer.dropped["error"] == errors_before


def test_a_timer_without_the_c_hot_path_says_so_once(monkeypatch, caplog):
    """An install without a compiler times in Python (dearer a region): the first timer says so, once;
    one that chose the Python path (GPUSCOPE_TIMING_NATIVE=0) is not told."""
    monkeypatch.setattr(hot, "_hotpath", None)
    monkeypatch.setattr(hot, "_warned_not_built", False)
    monkeypatch.delenv(hot.NATIVE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="gpuscope.timing"):
        assert hot.use_native(None) is False
        assert hot.use_native(None) is False
    said = [r for r in caplog.records if "C hot path is not built" in r.getMessage()]
    assert len(said) == 1
    caplog.clear()
    monkeypatch.setattr(hot, "_warned_not_built", False)
    monkeypatch.setenv(hot.NATIVE_ENV, "0")
    with caplog.at_level(logging.WARNING, logger="gpuscope.timing"):
        assert hot.use_native(None) is False
    assert not [r for r in caplog.records if "C hot path is not built" in r.getMessage()]
