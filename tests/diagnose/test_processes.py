"""Per-process verdicts end to end on real processes: real /proc, fake NVML naming their pids.

Children of the test spin one thread, sleep, or fork workers that spin; the fake NVML (pynvml's
names and structs, ``SamplingNvml``) lists them on GPUs as busy or idle as each case needs, and a
short live window through ``LiveSampler`` reads their CPU from /proc. The thresholds for a saturated
thread and a saturated worker are lowered (``LOADED``): on a busy two-core machine a spinning thread
may get a third of a core, and what is asserted is that the verdicts name the right pid and thread,
not how fast the machine is.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuscope.diagnose.findings import Limits
from gpuscope.diagnose.gpus import GpuSampler
from gpuscope.diagnose.live import LiveSampler
from gpuscope.diagnose.summary import Summary
from gpuscope.diagnose.verdicts import judge
from tests.diagnose.fakes import FakeHost, SamplingNvml, gpu_holding

#: What a loaded test machine can still show: a spinning thread or worker gets at least this much.
LOADED = Limits(saturated_core=0.25, worker_saturated=0.15)

SPINNER = """
import threading

def spin():
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/comm", "w") as f:  # the thread's name, as ps and py-spy show it
        f.write("spinner")
    print(tid, flush=True)
    while True:
        pass

threading.Thread(target=spin, daemon=True).start()
threading.Event().wait()  # the main thread blocks: all the CPU is the spinner's
"""
SLEEPER = """
import time
print("ready", flush=True)
time.sleep(3600)
"""
LOADER = """
import contextlib
import os

parent = os.getpid()
workers = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        with open("/proc/self/comm", "w") as f:
            f.write("loader_worker")
        while os.getppid() == parent:  # busy until its parent goes
            pass
        os._exit(0)
    workers.append(pid)
print(*workers, flush=True)
for _ in workers:
    os.wait()
"""


@dataclass
class Child:
    proc: subprocess.Popen
    line: str  # what it printed once ready

    @property
    def pid(self) -> int:
        return self.proc.pid


def _start(path: Path, deadline_s: float = 30.0) -> Child:
    # A new session: the loader's workers are in the child's process group, ended with it.
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], deadline_s)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        _stop(proc)
        pytest.fail(f"{path.name} did not start within {deadline_s}s")
    return Child(proc, line)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group of our own child (its workers with it)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Child]]:
    folder = tmp_path_factory.mktemp("children")
    started: dict[str, Child] = {}
    try:
        for name, script in (("spinner", SPINNER), ("sleeper", SLEEPER), ("loader", LOADER)):
            (folder / f"{name}.py").write_text(script)
            started[name] = _start(folder / f"{name}.py")
        yield started
    finally:
        for child in started.values():
            _stop(child.proc)


def window(nv: SamplingNvml, duration: float = 1.5) -> Summary:
    gpus = GpuSampler(interval=0.05, nv=nv, xid_wait_ms=20)
    sampler = LiveSampler(duration, 0.25, None, gpu_sampler=gpus, host_sampler=FakeHost(0.5))  # type: ignore[arg-type]
    return sampler.run().summary("testhost")


def test_spinning_thread_is_launch_bound_and_the_sleeper_an_idle_holder(children: dict[str, Child]) -> None:
    spinner, sleeper = children["spinner"], children["sleeper"]
    # GPU 0: the spinner's work keeps it 35% busy; GPU 1: the sleeper holds 6 GiB and runs nothing.
    nv = SamplingNvml([gpu_holding(spinner.pid, 35), gpu_holding(sleeper.pid, 0, gib=6)],
                      sm={0: {spinner.pid: 35}})
    summary = window(nv)
    findings = judge(summary, LOADED)

    bound = [f for f in findings if f.code == "launch_bound"]
    assert [f.evidence["pid"] for f in bound] == [spinner.pid], (findings, summary.processes)
    evidence = bound[0].evidence
    assert evidence["thread_id"] == int(spinner.line) and evidence["thread_name"] == "spinner"
    assert "spinner.py" in str(evidence["command"])
    assert evidence["process_sm_util"] == pytest.approx(0.35) and evidence["gpu_util"] == pytest.approx(0.35)
    assert float(evidence["thread_cpu"]) >= LOADED.saturated_core
    assert bound[0].severity == "problem" and "reduce-overhead" in bound[0].next_step

    idle = [f for f in findings if f.code == "idle_gpu_holder"]
    assert [f.evidence["pid"] for f in idle] == [sleeper.pid]
    assert idle[0].evidence["memory_bytes"] == 6 * 2**30 and idle[0].severity == "warning"
    assert {f.code for f in findings} == {"launch_bound", "idle_gpu_holder"}


def test_a_gpu_bound_process_is_no_problem(children: dict[str, Child]) -> None:
    spinner = children["spinner"]
    # The same saturated thread, its GPU 95% busy: the thread keeps up (it may be spinning in a sync).
    nv = SamplingNvml([gpu_holding(spinner.pid, 95)], sm={0: {spinner.pid: 95}})
    summary = window(nv)
    (process,) = summary.processes
    assert process.busiest_thread is not None and process.busiest_thread.id == int(spinner.line)
    assert judge(summary, LOADED) == []


def test_workers_at_full_tilt_with_a_starved_gpu_are_data_loader_bound(children: dict[str, Child]) -> None:
    loader = children["loader"]
    workers = {int(pid) for pid in loader.line.split()}
    nv = SamplingNvml([gpu_holding(loader.pid, 20)], sm={0: {loader.pid: 20}})
    summary = window(nv)
    findings = judge(summary, LOADED)
    assert [f.code for f in findings] == ["data_loader_bound"], (findings, summary.processes)
    evidence = findings[0].evidence
    # both workers spin; on a busy two-core machine one of them can be kept off a core for most of the
    # window, under the threshold for an active worker, and the finding then names the other alone
    assert evidence["pid"] == loader.pid and evidence["workers_active"] in (1, 2), evidence
    assert evidence["busiest_worker_pid"] in workers
    (process,) = summary.processes
    assert {w.id for w in process.workers} == workers
    assert {w.name for w in process.workers} == {"loader_worker"}


def test_processes_appear_in_the_table_and_the_json(children: dict[str, Child]) -> None:
    from gpuscope.diagnose import view

    sleeper = children["sleeper"]
    summary = window(SamplingNvml([gpu_holding(sleeper.pid, 0, gib=6)], sm={}), duration=0.5)
    table = view.table(summary)
    assert str(sleeper.pid) in table and "6.0 GiB" in table and "sleeper.py" in table
    (process,) = summary.to_json()["processes"]
    assert process["pid"] == sleeper.pid and process["gpus"] == ["0"]


def test_a_gpu_pid_outside_this_proc_is_listed_without_cpu() -> None:
    # A pid no process has here (pid_max is at most 2^22): NVML in another PID namespace would say so.
    ghost = 2**22 + 7
    summary = window(SamplingNvml([gpu_holding(ghost, 10)], sm={0: {ghost: 10}}), duration=0.5)
    (process,) = summary.processes
    assert process.pid == ghost and process.cpu is None and process.memory_bytes == 2 * 2**30
    assert any(f"{ghost}" in u and "PID namespace" in u for u in summary.unavailable)
    assert judge(summary) == []  # no CPU figures: nothing to say about it


def test_gpu_reading_keys_process_memory_by_pid(children: dict[str, Child]) -> None:
    """The exporter's processes collector, run in-process, gives each holder's memory under its pid."""
    sleeper = children["sleeper"]
    nv = SamplingNvml([gpu_holding(sleeper.pid, 0)], sm={})
    gpus = GpuSampler(interval=0.05, nv=nv, xid_wait_ms=20).start()
    try:
        deadline = time.monotonic() + 10
        while not any(gpus.read().get("0", {}).get("gpuscope_gpu_process_memory_bytes", {})):
            assert time.monotonic() < deadline, "the processes collector never published"
            time.sleep(0.02)  # polling the collector's thread, with a deadline
        memory = gpus.read()["0"]["gpuscope_gpu_process_memory_bytes"]
        assert memory == {str(sleeper.pid): 2.0 * 2**30}
    finally:
        gpus.stop()
