"""NVML trouble never stops the exporter: lost GPUs, failing, unsupported, slow and hung calls, no NVML."""

from __future__ import annotations

import logging
import threading
import time

import pynvml

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.config import Config
from gpuscope.nvml.exporter import Exporter
from tests.conftest import wait_for
from tests.nvml.conftest import value
from tests.nvml.fake_nvml import FakeGpu, FakeNvml


def _errors(ex: Exporter, call: str) -> float:
    return value(ex, cat.EXPORTER_ERRORS.name, call=call) or 0.0


class Gate(threading.Event):
    """A hang for the fake NVML (``gpu.hangs[call] = Gate()``) that says when a call is stuck in it.

    Waiting for ``entered`` instead of for a symptom makes "a call is wedged right now" a fact.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.entered.set()
        return super().wait(timeout)


def _rounds_started_after(ex: Exporter, since: float) -> None:
    """Until every collector has run a whole round that started after ``since`` (wall clock)."""
    for sampler in ex.samplers:
        name = sampler.collector.name

        def ended(n: str = name) -> float:
            return ex.store.snapshot()[n].last_round

        first = wait_for(lambda n=name: ended(n) > since and ended(n), what=f"a {name} round")
        wait_for(lambda n=name, f=first: ended(n) > f, what=f"the next {name} round")


def test_lost_gpu_is_marked_down_counted_once_and_others_continue(start_exporter, fake) -> None:
    ex = start_exporter(fake)
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="1") is not None)
    fake.gpus[1].lost = True
    wait_for(lambda: value(ex, cat.EXPORTER_GPU_UP.name, gpu="1") == 0, what="gpu 1 down")
    assert value(ex, cat.EXPORTER_GPUS_LOST.name) == 1
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="1") is None  # no stale values for a lost GPU
    # A round already past its check of GPU 1 when it was lost may still ask it once; count from
    # when every collector has started a round since.
    _rounds_started_after(ex, time.time())
    asked = sum(fake.gpus[1].calls.values())
    fake.gpus[0].temp_c = 55  # GPU 0 keeps being sampled
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 55)
    fake.gpus[0].temp_c = 56
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 56)
    assert value(ex, cat.EXPORTER_GPUS_LOST.name) == 1
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 1
    assert sum(fake.gpus[1].calls.values()) == asked  # a lost GPU is not asked again


def test_gpu_lost_at_startup(start_exporter) -> None:
    nv = FakeNvml([FakeGpu(), FakeGpu(lost=True)])
    ex = start_exporter(nv)
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") is not None)
    assert value(ex, cat.EXPORTER_GPUS_LOST.name) == 1
    assert value(ex, cat.EXPORTER_GPUS.name) == 1


def test_call_errors_are_counted_per_call_and_never_fatal(start_exporter, fake) -> None:
    fake.gpus[0].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_UNKNOWN
    ex = start_exporter(fake)
    wait_for(lambda: _errors(ex, "nvmlDeviceGetPowerUsage") >= 3, what="errors counted each round")
    assert value(ex, cat.GPU_POWER.name, gpu="0") is None
    assert value(ex, cat.GPU_POWER.name, gpu="1") == 120.0
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 40  # the rest of the round still ran
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 1
    del fake.gpus[0].errors["nvmlDeviceGetPowerUsage"]
    wait_for(lambda: value(ex, cat.GPU_POWER.name, gpu="0") == 120.0, what="recovery")


def test_not_supported_is_asked_once_and_reported(start_exporter, fake, caplog) -> None:
    fake.gpus[0].errors["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    caplog.set_level(logging.INFO, logger="gpuscope.exporter")
    ex = start_exporter(fake)
    rounds = fake.gpus[0].calls["nvmlDeviceGetUtilizationRates"]
    wait_for(lambda: fake.gpus[0].calls["nvmlDeviceGetUtilizationRates"] >= rounds + 5, what="5 more rounds")
    assert fake.gpus[0].calls["nvmlDeviceGetTemperature"] == 1
    assert _errors(ex, "nvmlDeviceGetTemperature") == 0
    assert value(ex, cat.EXPORTER_UNSUPPORTED.name, gpu="0", call="nvmlDeviceGetTemperature") == 1
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="0") is None
    assert sum("not supported" in r.getMessage() for r in caplog.records) == 1


def test_memory_info_falls_back_to_v1_without_reserved(start_exporter) -> None:
    class OldDriver(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, handle, version=None):
            if version:  # drivers before r510 lack nvmlDeviceGetMemoryInfo_v2
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return super().nvmlDeviceGetMemoryInfo(handle)

    ex = start_exporter(OldDriver())
    wait_for(lambda: value(ex, cat.GPU_MEMORY_USED.name, gpu="0") == 10 * 2**30)
    assert value(ex, cat.GPU_MEMORY_RESERVED.name, gpu="0") is None


def test_slow_call_does_not_delay_the_fast_collector(start_exporter, fake) -> None:
    ex = start_exporter(fake, call_timeout=600.0)  # the energy round waits for its call, however slow
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="1") is not None, what="a slow round")
    # GPU 0's energy call now takes until the test ends it: far slower than any interval. A device
    # round that waited on it, or ran on its thread, would never finish.
    slow = fake.gpus[0].hangs["nvmlDeviceGetTotalEnergyConsumption"] = Gate()
    assert slow.entered.wait(30), "the energy collector never called again"
    for temp in (60, 61, 62):
        fake.gpus[0].temp_c = temp
        wait_for(lambda t=temp: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == t,
                 what=f"temperature {temp} sampled while the energy call is in progress")
    wait_for(lambda: value(ex, cat.EXPORTER_STALENESS.name, collector="device")
             < value(ex, cat.EXPORTER_STALENESS.name, collector="energy"),
             what="device values fresher than the energy values the slow call holds up")
    assert not slow.is_set()  # all of it happened during the one slow call
    slow.set()
    wait_for(lambda: value(ex, cat.EXPORTER_STALENESS.name, collector="energy") < 0.3,
             what="energy values fresh again once the call returned")


def _scrape_cpu_seconds(ex: Exporter) -> float:
    from prometheus_client import generate_latest

    start = time.thread_time()
    generate_latest(ex.registry)
    return time.thread_time() - start


def test_hung_call_shows_as_staleness_while_scrapes_stay_fast(start_exporter, fake) -> None:
    ex = start_exporter(fake, call_timeout=0.2)
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="1") is not None)
    hang = fake.gpus[0].hangs["nvmlDeviceGetUtilizationRates"] = Gate()
    wait_for(lambda: value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 0, what="gpu 0 marked down")
    wait_for(lambda: value(ex, cat.EXPORTER_STALENESS.name, collector="device") > 0.6, what="staleness")
    # The scrape never waits on NVML: 20 scrapes finish while a call is stuck inside it until the
    # test releases it, each costing little CPU (CPU time: a loaded machine may pause the thread).
    assert hang.entered.is_set() and not hang.is_set()
    costs: list[float] = []
    scrapes = threading.Thread(target=lambda: costs.extend(_scrape_cpu_seconds(ex) for _ in range(20)))
    scrapes.start()
    scrapes.join(60)
    assert not scrapes.is_alive(), "a scrape waited on the hung NVML call"
    assert len(costs) == 20 and max(costs) < 0.05
    # The other GPU keeps fresh values; the hang is counted once, however many rounds it lasts.
    fake.gpus[1].temp_c = 70
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="1") == 70)
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="1") == 1
    assert _errors(ex, "nvmlDeviceGetUtilizationRates") == 1
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 40  # last values kept; staleness says how old
    # Rounds with a device that did not answer are not successes: the last one only grows old.
    wait_for(lambda: value(ex, cat.EXPORTER_LAST_SUCCESS.name, collector="device") < time.time() - 0.5,
             what="no successful device round while gpu 0 hangs")
    assert _errors(ex, "nvmlDeviceGetUtilizationRates") == 1
    del fake.gpus[0].hangs["nvmlDeviceGetUtilizationRates"]
    hang.set()
    wait_for(lambda: value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 1, what="recovery")
    wait_for(lambda: value(ex, cat.EXPORTER_STALENESS.name, collector="device") < 0.3)


def test_no_nvml_starts_logs_one_line_and_serves_health(start_exporter, caplog) -> None:
    nv = FakeNvml()
    nv.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    caplog.set_level(logging.INFO, logger="gpuscope.exporter")
    ex = start_exporter(nv)
    assert value(ex, cat.EXPORTER_GPUS.name) == 0
    assert _errors(ex, "nvmlInit") == 1
    assert value(ex, cat.EXPORTER_GPUS_LOST.name) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "NVML unavailable (NVML Shared Library Not Found): serving exporter health with 0 GPUs"]
    assert ex.healthz()["nvml"] is False


def test_no_gpus_runs_collectors_with_zero_devices(start_exporter) -> None:
    ex = start_exporter(FakeNvml(gpus=[]))
    wait_for(lambda: (value(ex, cat.EXPORTER_LAST_SUCCESS.name, collector="device") or 0) > 0)
    assert value(ex, cat.EXPORTER_GPUS.name) == 0
    assert ex.xid is None


def test_unexpected_exception_in_a_collector_is_counted_not_raised(start_exporter) -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetPerformanceState(self, handle):
            gpu = self._gpu(handle, "nvmlDeviceGetPerformanceState")
            if gpu is self.gpus[0]:
                raise RuntimeError("driver returned garbage")
            return gpu.pstate

    ex = start_exporter(Broken())
    wait_for(lambda: _errors(ex, "internal") >= 2)
    assert value(ex, cat.GPU_PSTATE.name, gpu="1") == 0
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 0


def test_stop_is_prompt_and_skips_nvml_shutdown_while_a_call_is_wedged(fake) -> None:
    ex = Exporter(Config(interval=0.05, slow_interval=0.1, call_timeout=0.1), nv=fake, xid_wait_ms=50).start()
    hang = fake.gpus[0].hangs["nvmlDeviceGetUtilizationRates"] = Gate()
    try:
        assert hang.entered.wait(30), "the call never hung"
        assert ex.samplers[0].wedged
        started = time.monotonic()
        ex.stop(timeout=30.0)
        # Prompt: stop() returns once the samplers have quit, not when its timeout runs out waiting on
        # the call that never returns (the bound is that timeout, generous for a loaded machine).
        assert time.monotonic() - started < 30.0
        assert fake.initialized  # nvmlShutdown under a wedged call could crash the driver library
    finally:
        hang.set()
