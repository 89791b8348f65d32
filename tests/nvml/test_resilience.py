"""NVML trouble never stops the exporter: lost GPUs, failing, unsupported, slow and hung calls, no NVML."""

from __future__ import annotations

import logging
import threading
import time

import pynvml

from gpuscope import catalogue as cat
from gpuscope.nvml.config import Config
from gpuscope.nvml.exporter import Exporter
from tests.conftest import wait_for
from tests.nvml.conftest import value
from tests.nvml.fake_nvml import FakeGpu, FakeNvml


def _errors(ex: Exporter, call: str) -> float:
    return value(ex, cat.EXPORTER_ERRORS.name, call=call) or 0.0


def test_lost_gpu_is_marked_down_counted_once_and_others_continue(start_exporter, fake) -> None:
    ex = start_exporter(fake)
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="1") is not None)
    fake.gpus[1].lost = True
    wait_for(lambda: value(ex, cat.EXPORTER_GPU_UP.name, gpu="1") == 0, what="gpu 1 down")
    assert value(ex, cat.EXPORTER_GPUS_LOST.name) == 1
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="1") is None  # no stale values for a lost GPU
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
    for gpu in fake.gpus:
        gpu.delays["nvmlDeviceGetTotalEnergyConsumption"] = 0.25  # well above the fast interval
    ex = start_exporter(fake, call_timeout=2.0)
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="1") is not None, what="a slow round")
    for temp in (60, 61, 62):
        fake.gpus[0].temp_c = temp
        wait_for(lambda t=temp: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == t, timeout=2.0)
    assert value(ex, cat.EXPORTER_COLLECTION_SECONDS.name, collector="energy") >= 0.5
    assert value(ex, cat.EXPORTER_COLLECTION_SECONDS.name, collector="device") < 0.25
    assert value(ex, cat.EXPORTER_STALENESS.name, collector="device") < 0.5


def _scrape_seconds(ex: Exporter) -> float:
    from prometheus_client import generate_latest

    start = time.perf_counter()
    generate_latest(ex.registry)
    return time.perf_counter() - start


def test_hung_call_shows_as_staleness_while_scrapes_stay_fast(start_exporter, fake) -> None:
    ex = start_exporter(fake, call_timeout=0.2)
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="1") is not None)
    hang = fake.gpus[0].hangs["nvmlDeviceGetUtilizationRates"] = threading.Event()
    wait_for(lambda: value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 0, what="gpu 0 marked down")
    wait_for(lambda: value(ex, cat.EXPORTER_STALENESS.name, collector="device") > 0.6, what="staleness")
    assert max(_scrape_seconds(ex) for _ in range(20)) < 0.05  # the scrape never waits on NVML
    # The other GPU keeps fresh values; the hang is counted once, however many rounds it lasts.
    fake.gpus[1].temp_c = 70
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="1") == 70)
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="1") == 1
    assert _errors(ex, "nvmlDeviceGetUtilizationRates") == 1
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 40  # last values kept; staleness says how old
    assert value(ex, cat.EXPORTER_LAST_SUCCESS.name, collector="device") < time.time() - 0.5
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
    hang = fake.gpus[0].hangs["nvmlDeviceGetUtilizationRates"] = threading.Event()
    wait_for(lambda: ex.samplers[0].wedged, what="wedged lane")
    started = time.monotonic()
    ex.stop(timeout=1.0)
    assert time.monotonic() - started < 1.5
    assert fake.initialized  # nvmlShutdown under a wedged call could crash the driver library
    hang.set()
