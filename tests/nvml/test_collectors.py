"""Every collector's values reach /metrics in base units, with identity only on gpuscope_gpu_info."""

from __future__ import annotations

import pynvml

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.calls import Calls
from gpuscope.nvml.collectors import ClockEventCollector
from gpuscope.nvml.devices import discover
from gpuscope.nvml.health import Health
from tests.conftest import wait_for
from tests.nvml.conftest import value, wait_first_rounds
from tests.nvml.fake_nvml import FakeGpu, FakeNvml


def test_device_collector_values_in_base_units(start_exporter) -> None:
    nv = FakeNvml([FakeGpu(util_gpu=97, util_mem=31, mem_used=80 * 2**30, temp_c=61, mem_temp_c=70,
                           power_mw=412_300, pstate=2, ecc=(3, 1), pcie_replays=7), FakeGpu()])
    ex = start_exporter(nv)
    wait_first_rounds(ex)  # a round has published every GPU (each GPU publishes from its own lane)
    gpu = nv.gpus[0]
    assert value(ex, cat.GPU_UTILIZATION.name, gpu="0") == 0.97
    assert value(ex, cat.GPU_MEMORY_UTILIZATION.name, gpu="0") == 0.31
    assert value(ex, cat.GPU_MEMORY_USED.name, gpu="0") == 80 * 2**30
    assert value(ex, cat.GPU_MEMORY_RESERVED.name, gpu="0") == gpu.mem_reserved
    assert value(ex, cat.GPU_MEMORY_FREE.name, gpu="0") == gpu.mem_total - 80 * 2**30 - gpu.mem_reserved
    assert value(ex, cat.GPU_MEMORY_TOTAL.name, gpu="0") == gpu.mem_total
    assert value(ex, cat.GPU_SM_CLOCK.name, gpu="0") == 1980e6
    assert value(ex, cat.GPU_MEMORY_CLOCK.name, gpu="0") == 2619e6
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 61
    assert value(ex, cat.GPU_MEMORY_TEMPERATURE.name, gpu="0") == 70
    assert value(ex, cat.GPU_POWER.name, gpu="0") == 412.3
    assert value(ex, cat.GPU_POWER_LIMIT.name, gpu="0") == 700.0
    assert value(ex, cat.GPU_PSTATE.name, gpu="0") == 2
    assert value(ex, cat.GPU_PCIE_REPLAY.name, gpu="0") == 7
    assert value(ex, cat.GPU_ECC_ERRORS.name, gpu="0", type="corrected") == 3
    assert value(ex, cat.GPU_ECC_ERRORS.name, gpu="0", type="uncorrected") == 1
    assert value(ex, cat.GPU_UTILIZATION.name, gpu="1") == 0.5
    assert value(ex, cat.EXPORTER_GPUS.name) == 2
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 1


def test_identity_is_on_the_info_metric_only(start_exporter, fake) -> None:
    ex = start_exporter(fake)
    assert value(ex, cat.GPU_INFO.name, gpu="0", uuid="GPU-00000000-fake", name="NVIDIA H200",
                 pci_bus_id="00000000:19:00.0", driver_version="580.159", mig_parent="") == 1
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="1"))
    for family in ex.registry.collect():
        if family.name != "gpuscope_gpu":
            assert all("uuid" not in s.labels for s in family.samples), family.name


def test_values_follow_the_device(start_exporter, fake) -> None:
    ex = start_exporter(fake)
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 40)
    fake.gpus[0].temp_c = 77
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 77, what="next fast round")


def test_slow_collectors_energy_remapped_nvlink(start_exporter) -> None:
    nv = FakeNvml([FakeGpu(energy_mj=1_234_500, remapped=(4, 1, 1, 0), nvlink_kib=(10, 20)), FakeGpu()])
    ex = start_exporter(nv)
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="0") is not None, what="energy")
    assert value(ex, cat.GPU_ENERGY.name, gpu="0") == 1234.5
    wait_for(lambda: value(ex, cat.GPU_REMAPPED_ROWS.name, gpu="0", cause="correctable") is not None)
    assert value(ex, cat.GPU_REMAPPED_ROWS.name, gpu="0", cause="uncorrectable") == 1
    assert value(ex, cat.GPU_REMAPPED_ROWS.name, gpu="0", cause="pending") == 1
    wait_for(lambda: value(ex, cat.GPU_NVLINK_BYTES.name, gpu="0", direction="tx") is not None)
    assert value(ex, cat.GPU_NVLINK_BYTES.name, gpu="0", direction="rx") == 20 * 1024
    # GPU 1 has no NVLink: the per-field NOT_SUPPORTED stops the asking, and says so.
    wait_for(lambda: value(ex, cat.EXPORTER_UNSUPPORTED.name, gpu="1", call="nvlink") == 1)
    assert value(ex, cat.GPU_NVLINK_BYTES.name, gpu="1", direction="tx") is None


def test_pcie_throughput_is_opt_in(start_exporter, fake) -> None:
    off = start_exporter(fake)
    wait_for(lambda: value(off, cat.GPU_ENERGY.name, gpu="0") is not None)
    assert value(off, cat.GPU_PCIE_THROUGHPUT.name, gpu="0", direction="tx") is None
    assert fake.gpus[0].calls["nvmlDeviceGetPcieThroughput"] == 0
    on = start_exporter(FakeNvml(), collectors=frozenset({"pcie_throughput"}))
    wait_for(lambda: value(on, cat.GPU_PCIE_THROUGHPUT.name, gpu="0", direction="rx") == 2000 * 1024)
    assert value(on, cat.GPU_PCIE_THROUGHPUT.name, gpu="0", direction="tx") == 1000 * 1024


def test_disabled_collectors_make_no_calls(start_exporter, fake) -> None:
    ex = start_exporter(fake, collectors=frozenset({"energy"}))
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="1") is not None)
    assert fake.gpus[0].calls["nvmlDeviceGetUtilizationRates"] == 0
    assert value(ex, cat.GPU_UTILIZATION.name, gpu="0") is None


def _clock_collector(nv: FakeNvml, now: list[float]) -> tuple[ClockEventCollector, object]:
    nv.nvmlInit()
    health = Health()
    device = discover(nv, health)[0]
    return ClockEventCollector(Calls(nv, health), max_gap=2.5, clock=lambda: now[0]), device


def test_clock_event_seconds_integrate_over_sample_intervals() -> None:
    nv, now = FakeNvml(), [100.0]
    collector, device = _clock_collector(nv, now)
    thermal = pynvml.nvmlClocksEventReasonSwThermalSlowdown
    nv.gpus[0].clock_reasons = thermal | pynvml.nvmlClocksEventReasonSwPowerCap
    samples = {}
    for _ in range(10):  # ten 1 s intervals, throttled at the start of each
        samples = {(s.metric.name, s.labels[1]): s.value for s in collector.sample(device)}
        now[0] += 1.0
    nv.gpus[0].clock_reasons = 0
    collector.sample(device)
    now[0] += 1.0
    samples = {(s.metric.name, s.labels[1]): s.value for s in collector.sample(device)}
    assert samples[(cat.GPU_CLOCK_EVENT_SECONDS.name, "sw_thermal_slowdown")] == 10.0
    assert samples[(cat.GPU_CLOCK_EVENT_SECONDS.name, "sw_power_cap")] == 10.0
    assert samples[(cat.GPU_CLOCK_EVENT_SECONDS.name, "hw_slowdown")] == 0.0
    assert samples[(cat.GPU_CLOCK_EVENT_ACTIVE.name, "sw_thermal_slowdown")] == 0.0


def test_clock_events_active_flags_and_long_gaps_not_credited() -> None:
    nv, now = FakeNvml(), [0.0]
    collector, device = _clock_collector(nv, now)
    nv.gpus[0].clock_reasons = pynvml.nvmlClocksEventReasonHwSlowdown
    first = {(s.metric.name, s.labels[1]): s.value for s in collector.sample(device)}
    assert first[(cat.GPU_CLOCK_EVENT_ACTIVE.name, "hw_slowdown")] == 1.0
    assert first[(cat.GPU_CLOCK_EVENT_ACTIVE.name, "gpu_idle")] == 0.0
    now[0] += 60.0  # e.g. a wedged call: nothing is known about this minute
    later = {(s.metric.name, s.labels[1]): s.value for s in collector.sample(device)}
    assert later[(cat.GPU_CLOCK_EVENT_SECONDS.name, "hw_slowdown")] == 0.0


def test_clock_events_fall_back_to_the_old_throttle_call() -> None:
    class OldNvml(FakeNvml):  # pynvml before 12.535 named it ...ThrottleReasons
        nvmlDeviceGetCurrentClocksEventReasons = None

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
            return self._gpu(handle, "throttle").clock_reasons

    nv, now = OldNvml(), [0.0]
    collector, device = _clock_collector(nv, now)
    nv.gpus[0].clock_reasons = pynvml.nvmlClocksThrottleReasonGpuIdle
    got = {(s.metric.name, s.labels[1]): s.value for s in collector.sample(device)}
    assert got[(cat.GPU_CLOCK_EVENT_ACTIVE.name, "gpu_idle")] == 1.0


def test_clock_events_through_the_running_exporter(start_exporter, fake) -> None:
    fake.gpus[1].clock_reasons = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    ex = start_exporter(fake)
    wait_for(lambda: value(ex, cat.GPU_CLOCK_EVENT_ACTIVE.name, gpu="1", reason="hw_thermal_slowdown") == 1)
    wait_for(lambda: (value(ex, cat.GPU_CLOCK_EVENT_SECONDS.name, gpu="1", reason="hw_thermal_slowdown")
                      or 0) >= 0.1, what="seconds to accumulate")
    assert value(ex, cat.GPU_CLOCK_EVENT_SECONDS.name, gpu="0", reason="hw_thermal_slowdown") == 0


def test_every_exported_family_is_in_the_catalogue(start_exporter) -> None:
    nv = FakeNvml([FakeGpu(nvlink_kib=(1, 1))])
    ex = start_exporter(nv, collectors=frozenset({"device", "clock_events", "energy", "remapped_rows",
                                                  "nvlink", "xid", "pcie_throughput", "processes"}))
    wait_for(lambda: value(ex, cat.GPU_PCIE_THROUGHPUT.name, gpu="0", direction="tx") is not None)
    names = {m.name for m in cat.all_metrics()}
    for family in ex.registry.collect():
        for sample in family.samples:
            if not sample.name.startswith("process_"):  # prometheus_client's own process metrics
                assert sample.name in names, sample.name
