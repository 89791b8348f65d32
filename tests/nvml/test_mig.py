"""MIG: instances get their own gpu label, identity and memory; board readings stay on the parent."""

from __future__ import annotations

from gpuscope.contract import catalogue as cat
from tests.conftest import wait_for
from tests.nvml.conftest import value
from tests.nvml.fake_nvml import FakeGpu, FakeNvml, FakeProcess


def _mig_host() -> FakeNvml:
    instances = [FakeGpu(name="NVIDIA H200 MIG 3g.71gb", gi=1, ci=0, mem_total=70 * 2**30, mem_used=5 * 2**30,
                         processes=[FakeProcess(321, 4 * 2**30, 1, 0)]),
                 FakeGpu(name="NVIDIA H200 MIG 3g.71gb", gi=2, ci=0, mem_total=70 * 2**30, mem_used=2**30)]
    return FakeNvml([FakeGpu(mig=instances), FakeGpu()])


def test_mig_instances_are_labelled_and_identified(start_exporter) -> None:
    nv = _mig_host()
    ex = start_exporter(nv, collectors=frozenset({"device", "processes"}))
    assert value(ex, cat.EXPORTER_GPUS.name) == 4
    assert value(ex, cat.GPU_INFO.name, gpu="0/gi1/ci0", uuid="MIG-0-0-fake", name="NVIDIA H200 MIG 3g.71gb",
                 pci_bus_id="00000000:19:00.0", driver_version="580.159", mig_parent="0") == 1
    wait_for(lambda: value(ex, cat.GPU_MEMORY_USED.name, gpu="0/gi2/ci0") == 2**30)
    assert value(ex, cat.GPU_MEMORY_USED.name, gpu="0/gi1/ci0") == 5 * 2**30
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 40  # board-level reading on the parent
    assert value(ex, cat.GPU_TEMPERATURE.name, gpu="0/gi1/ci0") is None
    assert value(ex, cat.GPU_UTILIZATION.name, gpu="0/gi1/ci0") is None
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="0/gi1/ci0") == 1
    assert value(ex, cat.EXPORTER_ERRORS.name, call="nvmlDeviceGetUtilizationRates") is None
    wait_for(lambda: value(ex, cat.GPU_PROCESS_MEMORY.name, gpu="0/gi1/ci0", pid="321", process="",
                           container_id="") == 4 * 2**30, what="process on its MIG instance")


def test_mig_instances_are_not_asked_board_level_calls_twice(start_exporter) -> None:
    nv = _mig_host()
    start_exporter(nv, collectors=frozenset({"device"}))
    inst = nv.gpus[0].mig[0]
    wait_for(lambda: inst.calls["nvmlDeviceGetMemoryInfo"] >= 5)
    assert inst.calls["nvmlDeviceGetUtilizationRates"] == 1
    assert inst.calls["nvmlDeviceGetPowerUsage"] == 1
    assert nv.gpus[1].calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 0  # MIG off: no instances asked
