"""The per-process pieces on set numbers: /proc stat parsing, CPU rates, descendants, each verdict's
edges, the server-address verdict and the memory-pressure edge. (``test_processes.py`` runs them on
real processes.)"""

from __future__ import annotations

import pytest

from gpuscope.contract.profiles import Thresholds
from gpuscope.diagnose.findings import Limits
from gpuscope.diagnose.processes import (
    CLK_TCK,
    CpuSnapshot,
    GpuUse,
    TaskStat,
    descendants,
    join,
    parse_stat,
    rate,
)
from gpuscope.diagnose.summary import GpuSummary, ProcessSummary, ServerSummary, Summary, TaskSummary
from gpuscope.diagnose.verdicts import judge

# pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ... starttime
STAT = "{pid} ({comm}) R {ppid} 1 1 0 -1 4194304 100 0 0 0 {utime} {stime} 0 0 20 0 3 0 {start} 1000 50"


def test_stat_name_may_hold_spaces_and_parentheses() -> None:
    stat = parse_stat(STAT.format(pid=42, comm="pt_main) (x y", ppid=7, utime=150, stime=50, start=900))
    assert stat == TaskStat(42, "pt_main) (x y", 7, 200, 900)
    assert parse_stat("") is None and parse_stat("42 (short) R 1") is None


def test_rate_counts_from_the_first_reading_or_from_birth() -> None:
    tick = 1 / CLK_TCK
    before = TaskStat(1, "a", 0, 100, 10)
    after = TaskStat(1, "a", 0, 100 + CLK_TCK, 10)  # one second of CPU
    assert rate(before, after, 100.0, 102.0) == pytest.approx(0.5)
    born_at = 101.0  # born mid-window: its CPU over its own life, not over the window
    young = TaskStat(2, "w", 1, CLK_TCK // 2, int(born_at * CLK_TCK))
    assert rate(None, young, 100.0, 102.0) == pytest.approx(0.5, abs=2 * tick)
    reused = TaskStat(1, "b", 0, CLK_TCK // 2, int(born_at * CLK_TCK))  # same pid, another start: new
    assert rate(before, reused, 100.0, 102.0) == pytest.approx(0.5, abs=2 * tick)
    assert rate(None, TaskStat(3, "old", 1, 500, 10), 100.0, 102.0) is None  # missed by the first reading
    assert rate(None, TaskStat(4, "new", 1, 1, int(101.95 * CLK_TCK)), 100.0, 102.0) is None  # too short


def test_descendants_leave_out_gpu_processes_and_what_is_under_them() -> None:
    tree = {p: TaskStat(p, str(p), parent, 0, 0) for p, parent in
            ((10, 1), (11, 10), (12, 11), (13, 10), (14, 13), (20, 1))}
    assert sorted(descendants(10, tree, skip={13})) == [11, 12]
    assert descendants(20, tree, skip=()) == []


def test_join_keeps_a_process_without_cpu_readings() -> None:
    use = {5: GpuUse({"1", "0"}, 3e9, None, 0.4)}
    (p,) = join(use, None, None, {5: "python serve.py"})
    assert p.gpus == ["0", "1"] and p.command == "python serve.py" and p.cpu is None and p.gpu_busy == 0.4
    after = CpuSnapshot(10.0, {5: TaskStat(5, "python", 1, 10, 0)})
    (q,) = join(use, CpuSnapshot(9.0), after, {})
    assert q.command == "python" and q.cpu is None  # no baseline for it: no rate


def _proc(thread_cpu: float = 0.0, sm: float | None = 0.3, gpu: float | None = 0.3, cpu: float | None = None,
          workers: tuple[float, ...] = (), gpus: tuple[str, ...] = ("0",), pid: int = 100) -> ProcessSummary:
    return ProcessSummary(
        pid, "python train.py", list(gpus), 4e9, sm, gpu, thread_cpu if cpu is None else cpu,
        TaskSummary(pid + 1, "pt_main_thread", thread_cpu), threads=4,
        workers=[TaskSummary(pid + 10 + i, "pt_data_worker", c) for i, c in enumerate(workers)])


def _codes(*processes: ProcessSummary, cpu: float = 0.3, cores: int | None = 8) -> list[str]:
    s = Summary("live", 10.0, cpu=cpu, cpu_cores=cores, processes=list(processes))
    return [f.code for f in judge(s)]


@pytest.mark.parametrize("process, codes", [
    (_proc(thread_cpu=0.99, sm=0.40), ["launch_bound"]),                      # the example: GPU 40% busy
    (_proc(thread_cpu=0.99, sm=None, gpu=0.35), ["launch_bound"]),            # no per-process samples
    (_proc(thread_cpu=0.99, sm=0.95, gpu=0.95), []),                          # GPU-bound: no problem
    (_proc(thread_cpu=0.99, sm=None, gpu=None), []),                          # nothing says how busy
    (_proc(thread_cpu=0.99, sm=0.0, gpu=0.95), []),                           # no samples, GPU busy
    (_proc(thread_cpu=0.70, sm=0.20), []),                                    # nothing saturated
    (_proc(thread_cpu=0.10, sm=0.15, workers=(0.97, 0.95, 0.99, 0.0)), ["data_loader_bound"]),
    (_proc(thread_cpu=0.10, sm=0.15, workers=(0.40, 0.35)), []),              # workers keep up
    (_proc(thread_cpu=0.10, sm=0.90, workers=(0.97, 0.95)), []),              # GPU busy anyway
    (_proc(thread_cpu=0.0, sm=0.0, gpu=0.0), ["idle_gpu_holder"]),
    (_proc(thread_cpu=0.0, sm=0.0, workers=(0.3,)), []),                      # its workers are busy
    (_proc(thread_cpu=0.0, sm=0.0, cpu=0.2), []),                             # some thread works
])
def test_each_process_verdict(process: ProcessSummary, codes: list[str]) -> None:
    assert _codes(process) == codes


def test_a_thread_can_be_saturated_and_the_workers_too() -> None:
    both = _proc(thread_cpu=0.98, sm=0.2, workers=(0.9, 0.9))
    assert _codes(both) == ["launch_bound", "data_loader_bound"]


def test_more_workers_than_cores_on_a_saturated_host_are_data_loader_bound() -> None:
    crowded = _proc(thread_cpu=0.1, sm=0.1, workers=(0.45,) * 16)  # 16 workers sharing 8 cores
    assert _codes(crowded, cpu=0.97, cores=8) == ["data_loader_bound"]
    assert _codes(crowded, cpu=0.97, cores=32) == []  # they use a quarter of the host: not them
    assert _codes(crowded, cpu=0.60, cores=8) == []   # the host has room: the pool keeps up


def test_without_per_process_samples_an_idle_holder_is_judged_only_alone_on_its_gpu() -> None:
    quiet = _proc(sm=None, gpu=0.0, pid=100)
    assert _codes(quiet) == ["idle_gpu_holder"]
    other = _proc(sm=None, gpu=0.0, pid=200, thread_cpu=0.5)
    assert _codes(quiet, other) == []  # the GPU's figure is theirs together


def test_thresholds_can_be_set() -> None:
    s = Summary("live", 2.0, processes=[_proc(thread_cpu=0.5, sm=0.3)])
    assert judge(s) == [] and [f.code for f in judge(s, Limits(saturated_core=0.4))] == ["launch_bound"]


def test_a_named_server_that_never_answered_is_a_problem() -> None:
    s = Summary("live", 2.0, server_asked="http://10.0.0.9:8000/metrics", server_tried=3, server_failed=3,
                server_error="[Errno 111] Connection refused")
    (f,) = judge(s)
    assert (f.code, f.severity) == ("server_unreachable", "problem")
    assert f.title == "server at http://10.0.0.9:8000/metrics did not answer: [Errno 111] Connection refused"
    flaky = Summary("live", 2.0, server=ServerSummary("gpuscope-server"), server_asked="http://x/metrics",
                    server_tried=4, server_failed=1, server_error="timed out")
    assert [(f.code, f.severity) for f in judge(flaky)] == [("server_unreachable", "warning")]
    default = Summary("live", 2.0, server_tried=3, server_failed=3, server_error="refused")  # not named
    assert judge(default) == []


def test_memory_pressure_starts_where_the_alert_rules_put_it() -> None:
    full = Thresholds().bottleneck_memory_ratio
    at, below = (Summary("live", 2.0, gpus=[GpuSummary("0", memory_used_ratio=r)])
                 for r in (full, full - 0.01))
    assert [(f.code, f.severity) for f in judge(at)] == [("memory_pressure", "warning")]
    assert judge(below) == []
