"""Real NVML on a real GPU: exported values agree with nvidia-smi; a torch process is attributed.

Run on the GPU host (gpuscope is not installed there, so put exporter/ on the path)::

    PYTHONPATH=src python -m pytest -q -m gpu tests/nvml/test_gpu.py

Samplers start with an hour-long interval, so after their first round the test drives each
round itself (``refresh``) right before asking nvidia-smi: both read the GPU at nearly the
same moment. Readings that move on their own (power, clocks, utilization) get tolerances
and up to three attempts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.config import COLLECTORS, Config
from gpuscope.nvml.exporter import Exporter
from tests.conftest import wait_for
from tests.nvml.conftest import value

pytestmark = pytest.mark.gpu
MIB = 2**20
SMI_FIELDS = ("index", "uuid", "name", "pci.bus_id", "driver_version", "utilization.gpu",
              "utilization.memory", "memory.total", "memory.used", "memory.free", "memory.reserved",
              "clocks.sm", "clocks.mem",
              "temperature.gpu", "temperature.memory", "power.draw", "enforced.power.limit", "pstate",
              "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total")


def smi(fields: tuple[str, ...] = SMI_FIELDS, query: str = "--query-gpu") -> list[dict[str, str]]:
    path = shutil.which("nvidia-smi")
    assert path, "nvidia-smi not found on the GPU host"
    out = subprocess.run([path, f"{query}={','.join(fields)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [dict(zip(fields, (v.strip() for v in line.split(",")), strict=True))
            for line in out.strip().splitlines() if line.strip()]


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    ex = Exporter(Config(interval=3600, slow_interval=3600, call_timeout=10,
                         collectors=frozenset(COLLECTORS))).start()
    assert ex.nvml_ok and ex.devices, "real NVML answered no GPUs"
    for sampler in ex.samplers:
        wait_for(lambda s=sampler: value(ex, cat.EXPORTER_LAST_SUCCESS.name, collector=s.collector.name),
                 timeout=30, what=f"first {sampler.collector.name} round")
    yield ex
    ex.stop()


def refresh(ex: Exporter, *names: str) -> None:
    """Run one round of the named collectors (all if none) on this thread."""
    for sampler in ex.samplers:
        if not names or sampler.collector.name in names:
            assert sampler.run_round(), f"{sampler.collector.name} round failed"


def agree(check: Callable[[], None], attempts: int = 3) -> None:
    """Readings that move by themselves: retry the paired read a couple of times."""
    for attempt in range(attempts):
        try:
            check()
            return
        except AssertionError:
            if attempt == attempts - 1:
                raise


def test_identity_and_static_values_match_nvidia_smi(exporter: Exporter) -> None:
    for row in smi():
        gpu = row["index"]
        device = next(d for d in exporter.devices if d.label == gpu)
        assert (device.uuid, device.name) == (row["uuid"], row["name"])
        assert exporter.driver_version == row["driver_version"]
        assert device.pci_bus_id.upper() == row["pci.bus_id"].upper()
        total = value(exporter, cat.GPU_MEMORY_TOTAL.name, gpu=gpu)
        assert total / MIB == pytest.approx(float(row["memory.total"]), abs=1)
        limit = value(exporter, cat.GPU_POWER_LIMIT.name, gpu=gpu)
        assert limit == pytest.approx(float(row["enforced.power.limit"]), abs=1)
        for kind, field in (("corrected", "ecc.errors.corrected.volatile.total"),
                            ("uncorrected", "ecc.errors.uncorrected.volatile.total")):
            expected = number(row[field])
            if expected is not None:
                assert value(exporter, cat.GPU_ECC_ERRORS.name, gpu=gpu, type=kind) == expected


def test_moving_values_match_nvidia_smi(exporter: Exporter) -> None:
    def check() -> None:
        refresh(exporter, "device")
        for row in smi():
            gpu = row["index"]

            def got(metric: cat.Metric, gpu: str = gpu) -> float:
                v = value(exporter, metric.name, gpu=gpu)
                assert v is not None, f"{metric.name} missing for gpu {gpu}"
                return v

            total = float(row["memory.total"])
            for metric, field in ((cat.GPU_MEMORY_USED, "memory.used"), (cat.GPU_MEMORY_FREE, "memory.free"),
                                  (cat.GPU_MEMORY_RESERVED, "memory.reserved")):
                if number(row[field]) is not None:
                    tolerance = max(64, 0.01 * total)
                    assert got(metric) / MIB == pytest.approx(float(row[field]), abs=tolerance), field
            assert got(cat.GPU_TEMPERATURE) == pytest.approx(float(row["temperature.gpu"]), abs=3)
            hbm = number(row["temperature.memory"])
            if hbm is not None:
                assert got(cat.GPU_MEMORY_TEMPERATURE) == pytest.approx(hbm, abs=3)
            power = float(row["power.draw"])
            assert got(cat.GPU_POWER) == pytest.approx(power, abs=max(30.0, 0.15 * power))
            sm = float(row["clocks.sm"])
            assert got(cat.GPU_SM_CLOCK) / 1e6 == pytest.approx(sm, abs=max(100.0, 0.15 * sm))
            assert got(cat.GPU_MEMORY_CLOCK) / 1e6 == pytest.approx(float(row["clocks.mem"]), rel=0.05)
            assert got(cat.GPU_UTILIZATION) == pytest.approx(float(row["utilization.gpu"]) / 100, abs=0.15)
            assert got(cat.GPU_MEMORY_UTILIZATION) == pytest.approx(float(row["utilization.memory"]) / 100,
                                                                    abs=0.15)
            assert got(cat.GPU_PSTATE) == float(row["pstate"].lstrip("P"))

    agree(check)


def test_energy_counter_agrees_with_power(exporter: Exporter) -> None:
    gpu = exporter.devices[0].label
    refresh(exporter, "energy", "device")
    e0, t0 = value(exporter, cat.GPU_ENERGY.name, gpu=gpu), time.monotonic()
    powers = []
    while time.monotonic() - t0 < 3.0:  # bounded: 3 s of ~10 power readings
        refresh(exporter, "device")
        powers.append(value(exporter, cat.GPU_POWER.name, gpu=gpu))
        time.sleep(0.3)  # paces the power readings across the window; nothing is awaited
    refresh(exporter, "energy")
    e1, t1 = value(exporter, cat.GPU_ENERGY.name, gpu=gpu), time.monotonic()
    mean_power = (e1 - e0) / (t1 - t0)
    assert mean_power == pytest.approx(sum(powers) / len(powers), rel=0.5)


def test_clock_event_reasons_match_nvidia_smi(exporter: Exporter) -> None:
    from gpuscope.nvml.collectors import CLOCK_EVENT_REASONS

    def check() -> None:
        refresh(exporter, "clock_events")
        try:
            rows = smi(("index", "clocks_event_reasons.active"))
            field = "clocks_event_reasons.active"
        except subprocess.CalledProcessError:  # older nvidia-smi
            rows = smi(("index", "clocks_throttle_reasons.active"))
            field = "clocks_throttle_reasons.active"
        for row in rows:
            mask = int(row[field], 16)
            for reason, bit in CLOCK_EVENT_REASONS:
                got = value(exporter, cat.GPU_CLOCK_EVENT_ACTIVE.name, gpu=row["index"], reason=reason)
                assert got == (1.0 if mask & bit else 0.0), (reason, row[field])

    agree(check)


def test_xid_events_are_registered_and_no_call_fails(exporter: Exporter) -> None:
    gpu = exporter.devices[0].label
    assert value(exporter, cat.GPU_XID_ERRORS.name, gpu=gpu, xid="79") is not None, "XID registration failed"
    refresh(exporter)
    unsupported = [(d.label, sorted(d.unsupported)) for d in exporter.devices]
    assert exporter.health.errors() == {}, f"NVML calls failed: {exporter.health.errors()}; {unsupported=}"


def test_scrape_is_fast_on_real_nvml(exporter: Exporter) -> None:
    from prometheus_client import generate_latest

    times = []
    for _ in range(200):
        start = time.perf_counter()
        generate_latest(exporter.registry)
        times.append(time.perf_counter() - start)
    times.sort()
    assert times[197] < 0.005 * max(1, len(exporter.devices)), f"p99 {times[197] * 1e3:.2f} ms"


@pytest.fixture(scope="module")
def torch_busy() -> Iterator[Callable[[float], None]]:
    torch = pytest.importorskip("torch")
    block = torch.empty(2**28, dtype=torch.float32, device="cuda:0")  # 1 GiB held by this process
    a = torch.randn(4096, 4096, device="cuda:0")

    def run(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for _ in range(10_000):  # bounded in count and time
            if time.monotonic() > deadline:
                break
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()

    yield run
    del block


def _this_process(exporter: Exporter) -> dict[str, str]:
    with open(f"/proc/{os.getpid()}/comm") as f:
        comm = f.read().strip()
    from gpuscope.nvml.procinfo import container_id

    with open(f"/proc/{os.getpid()}/cgroup") as f:
        cid = container_id(f.read())
    return {"gpu": "0", "pid": str(os.getpid()), "process": comm, "container_id": cid}


def test_torch_process_memory_is_attributed(exporter: Exporter, torch_busy) -> None:
    torch_busy(0.1)
    refresh(exporter)  # every collector: the device figure compared below must be as fresh
    labels = _this_process(exporter)
    used = value(exporter, cat.GPU_PROCESS_MEMORY.name, **labels)
    exported = [s.labels for f in exporter.registry.collect() for s in f.samples
                if s.name == cat.GPU_PROCESS_MEMORY.name]
    assert used is not None and used >= 2**30, f"process memory {used} for {labels}; exported: {exported}"
    apps = smi(("pid", "used_memory"), "--query-compute-apps")
    mine = [float(a["used_memory"]) for a in apps if a["pid"] == str(os.getpid())]
    assert mine and used / MIB == pytest.approx(mine[0], abs=64)
    assert used < value(exporter, cat.GPU_MEMORY_USED.name, gpu="0") + 1  # its own figure, not the device's


def test_torch_process_sm_utilization_is_attributed(exporter: Exporter, torch_busy) -> None:
    refresh(exporter, "processes")  # moves the sample timestamp to now
    torch_busy(2.0)
    refresh(exporter, "processes")
    device = next(d for d in exporter.devices if d.label == "0")
    if "nvmlDeviceGetProcessUtilization" in device.unsupported:
        pytest.skip("this GPU does not report per-process utilization")
    sm = value(exporter, cat.GPU_PROCESS_SM_UTILIZATION.name, **_this_process(exporter))
    assert sm is not None and sm > 0.2, f"SM utilization {sm} while running matmuls"
