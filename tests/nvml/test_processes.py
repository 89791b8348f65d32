"""Per-process attribution: each process's own NVML figures, names from /proc, container ids, a cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.procinfo import ProcessNames, container_id
from tests.conftest import wait_for
from tests.nvml.conftest import value
from tests.nvml.fake_nvml import FakeGpu, FakeNvml, FakeProcess

CID = "3f2a" + "0123456789abcdef" * 3 + "0123456789ab"
POD = "pod8c1b2c1e-5d2b-4f6e-9a51-1d9f0f2b7c3a"


@pytest.mark.parametrize("cgroup", [
    f"12:memory:/docker/{CID}\n11:cpu:/docker/{CID}\n",
    f"0::/system.slice/docker-{CID}.scope\n",
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-{POD}.slice/cri-containerd-{CID}.scope\n",
    f"11:cpuset:/kubepods/besteffort/{POD}/{CID}\n",
    f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-{POD}.slice/crio-{CID}.scope\n",
    f"0::/machine.slice/libpod-{CID}.scope/container\n",
])
def test_container_id_from_every_cgroup_layout(cgroup: str) -> None:
    assert container_id(cgroup) == CID


@pytest.mark.parametrize("cgroup", [
    "0::/user.slice/user-1000.slice/session-2.scope\n",
    "0::/\n",
    "",
    "0::/system.slice/docker-" + "a" * 63 + ".scope\n",  # not a full 64-hex id
])
def test_no_container_id_outside_containers(cgroup: str) -> None:
    assert container_id(cgroup) == ""


def _proc(root: Path, pid: int, comm: str, cgroup: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "comm").write_text(comm + "\n")
    (root / str(pid) / "cgroup").write_text(cgroup)


def test_process_names_cache_and_forget(tmp_path: Path) -> None:
    _proc(tmp_path, 7, "python", f"0::/system.slice/docker-{CID}.scope\n")
    names = ProcessNames(str(tmp_path))
    assert names.lookup(7) == ("python", CID)
    assert names.lookup(8) == ("", "")  # gone, or in another PID namespace
    (tmp_path / "7" / "comm").write_text("reused\n")
    assert names.lookup(7) == ("python", CID)  # cached while the PID stays on the GPU
    names.forget_except(set())
    assert names.lookup(7)[0] == "reused"


def _round(ex, name: str) -> None:
    """One round of a collector on this thread (its own thread sleeps an hour after its first)."""
    sampler = next(s for s in ex.samplers if s.collector.name == name)
    wait_for(lambda: value(ex, cat.EXPORTER_LAST_SUCCESS.name, collector=name), what=f"first {name} round")
    assert sampler.run_round()


def test_per_process_memory_and_sm_utilization(start_exporter, tmp_path: Path) -> None:
    _proc(tmp_path, 100, "vllm", f"0::/system.slice/docker-{CID}.scope\n")
    _proc(tmp_path, 200, "python", "0::/user.slice\n")
    gpu = FakeGpu(util_gpu=99, mem_used=40 * 2**30,
                  processes=[FakeProcess(100, 30 * 2**30), FakeProcess(200, 2**30)],
                  proc_samples=[(100, 1_000, 90), (100, 2_000, 70)])
    ex = start_exporter(FakeNvml([gpu]), proc_root=str(tmp_path), slow_interval=3600,
                        collectors=frozenset({"device", "processes"}))
    a = {"gpu": "0", "pid": "100", "process": "vllm", "container_id": CID}
    b = {"gpu": "0", "pid": "200", "process": "python", "container_id": ""}
    wait_for(lambda: value(ex, cat.GPU_PROCESS_MEMORY.name, **a) is not None, what="first process round")
    assert value(ex, cat.GPU_PROCESS_MEMORY.name, **a) == 30 * 2**30
    assert value(ex, cat.GPU_PROCESS_MEMORY.name, **b) == 2**30
    # Each process's own samples, never the device's 99%: mean of 90 and 70; none for pid 200 → 0.
    assert value(ex, cat.GPU_PROCESS_SM_UTILIZATION.name, **a) == pytest.approx(0.8)
    assert value(ex, cat.GPU_PROCESS_SM_UTILIZATION.name, **b) == 0.0
    assert value(ex, cat.EXPORTER_PROCESSES_OMITTED.name, gpu="0") == 0
    # The next round asks only for newer samples; with none, a process counts as idle.
    _round(ex, "processes")
    assert value(ex, cat.GPU_PROCESS_SM_UTILIZATION.name, **a) == 0.0
    gpu.proc_samples.append((100, 3_000, 40))
    _round(ex, "processes")
    assert value(ex, cat.GPU_PROCESS_SM_UTILIZATION.name, **a) == pytest.approx(0.4)
    gpu.processes = [FakeProcess(200, 2**30)]  # pid 100 left the GPU
    _round(ex, "processes")
    assert value(ex, cat.GPU_PROCESS_MEMORY.name, **a) is None


def test_process_count_is_capped_largest_first(start_exporter, tmp_path: Path) -> None:
    procs = [FakeProcess(pid, pid * 2**20) for pid in (11, 12, 13, 14, 15)]
    nv = FakeNvml([FakeGpu(processes=procs)])
    ex = start_exporter(nv, proc_root=str(tmp_path), processes_max=2, collectors=frozenset({"processes"}))
    wait_for(lambda: value(ex, cat.EXPORTER_PROCESSES_OMITTED.name, gpu="0") == 3)
    exported = {s.labels["pid"] for f in ex.registry.collect() for s in f.samples
                if s.name == cat.GPU_PROCESS_MEMORY.name}
    assert exported == {"15", "14"}


def test_process_attribution_is_opt_in(start_exporter, fake) -> None:
    fake.gpus[0].processes = [FakeProcess(1, 2**20)]
    ex = start_exporter(fake)
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="0") is not None)
    assert fake.gpus[0].calls["nvmlDeviceGetComputeRunningProcesses"] == 0
    exported = {s.name for f in ex.registry.collect() for s in f.samples}
    assert not [name for name in exported if name.startswith("gpuscope_gpu_process")]
