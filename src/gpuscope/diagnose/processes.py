"""The CPU side of the processes that hold a GPU, from /proc, joined with what NVML says of them.

NVML (the exporter's ``processes`` collector, read by ``gpus.py``) says which pid holds which GPU,
how much memory and, where the driver keeps per-process samples, how busy its kernels keep the SMs.
It says nothing of the host side, and that is where a launch-bound or a data-loader-bound job shows:
one Python thread at 100% of a core, or worker processes that cannot keep up. /proc has it, with no
server and no agent: ``/proc/PID/stat`` (the process, every thread together),
``/proc/PID/task/TID/stat`` (one thread; its ``comm`` is the thread's name) and ``/proc/PID/cmdline``.

CPU time is read twice, at the start and at the end of the window; the difference over the time in
between is a rate in cores (1.0: one core busy all the time). The first reading covers every process,
because which pids hold a GPU is known only as NVML's rounds come in; the last covers the processes
on a GPU, their threads and their descendants. A thread or process born during the window counts
from its birth (``starttime``), so a worker started mid-window is not diluted by time it did not live.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from gpuscope.diagnose.summary import ProcessSummary, TaskSummary

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: A rate over less time than this is mostly the clock tick's rounding (10 ms at 100 Hz): not given.
MIN_SPAN_S = 0.25
#: Descendants kept per process in the summary (busiest first): enough for any data loader's pool.
MAX_WORKERS = 64
#: Longest command line shown (a launcher's argv can be kilobytes of flags).
MAX_COMMAND = 200


class TaskStat(NamedTuple):
    """What one ``stat`` file says that the verdicts need."""

    id: int
    name: str
    ppid: int
    ticks: int  # utime + stime, in clock ticks (a process's counts every thread, exited ones too)
    start: int  # starttime: clock ticks after boot


def parse_stat(text: str) -> TaskStat | None:
    """One ``/proc/.../stat`` line, or None when it is not one.

    The name sits in parentheses and may itself hold spaces and parentheses, so the fields after it
    are found from the last ``)``.
    """
    head, sep, tail = text.rpartition(")")
    pid_text, _, name = head.partition(" (")
    fields = tail.split()
    if not sep or not pid_text.strip().isdigit() or len(fields) < 20:
        return None
    try:  # fields[0] is the state; then ppid, ..., utime (11), stime (12), ..., starttime (19)
        ticks = int(fields[11]) + int(fields[12])
        return TaskStat(int(pid_text), name, int(fields[1]), ticks, int(fields[19]))
    except ValueError:
        return None


def _boottime() -> float:
    # /proc's starttime counts from boot, suspend included: the same clock makes births comparable.
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass
class CpuSnapshot:
    """CPU times of processes (and of the threads of some) at one moment."""

    at: float  # seconds since boot
    processes: dict[int, TaskStat] = field(default_factory=dict)
    threads: dict[int, dict[int, TaskStat]] = field(default_factory=dict)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:  # it exited between the listing and the read, or hidepid hides it
        return ""


class ProcReader:
    """Reads CPU times, names and command lines under ``proc_root``."""

    def __init__(self, proc_root: str = "/proc", clock: Callable[[], float] = _boottime) -> None:
        self.root = Path(proc_root)
        self.clock = clock

    def _pids(self, under: Path) -> list[int]:
        try:
            return [int(e.name) for e in os.scandir(under) if e.name.isdigit()]
        except OSError:
            return []

    def snapshot(self, threads_of: Collection[int] | None = None) -> CpuSnapshot:
        """Every process's CPU time, and the threads of ``threads_of`` (None: of every process)."""
        begun = self.clock()
        processes: dict[int, TaskStat] = {}
        threads: dict[int, dict[int, TaskStat]] = {}
        for pid in self._pids(self.root):
            stat = parse_stat(_read(self.root / str(pid) / "stat"))
            if stat is None:
                continue
            processes[pid] = stat
            if threads_of is None or pid in threads_of:
                task = self.root / str(pid) / "task"
                found = (parse_stat(_read(task / str(tid) / "stat")) for tid in self._pids(task))
                threads[pid] = {t.id: t for t in found if t is not None}
        # Reading every process of a big host takes a while: the middle is the reading's time.
        return CpuSnapshot((begun + self.clock()) / 2, processes, threads)

    def command(self, pid: int) -> str:
        """The command line, spaces for its NULs; "" when unreadable (exited, kernel thread)."""
        raw = _read(self.root / str(pid) / "cmdline").replace("\0", " ").strip()
        return raw if len(raw) <= MAX_COMMAND else raw[: MAX_COMMAND - 3] + "..."


def rate(before: TaskStat | None, after: TaskStat, t0: float, t1: float) -> float | None:
    """Cores used between two readings; None where it cannot be told.

    A task missing from the first reading counts from its birth, when it was born after that reading;
    one born before it but not read then (a race with its listing) has no baseline. The same id with
    another start time is a reused pid: a new task.
    """
    if before is not None and before.start == after.start:
        ticks, since = after.ticks - before.ticks, t0
    else:
        born = after.start / CLK_TCK
        if born < t0:
            return None
        ticks, since = after.ticks, born
    span = t1 - since
    if span < MIN_SPAN_S:
        return None
    return max(0.0, ticks / CLK_TCK / span)


@dataclass
class GpuUse:
    """What NVML said of one pid over the window (``live.py`` builds it from the readings)."""

    gpus: set[str] = field(default_factory=set)
    memory_bytes: float | None = None
    sm_util: float | None = None
    gpu_util: float | None = None


def descendants(pid: int, processes: Mapping[int, TaskStat], skip: Collection[int]) -> list[int]:
    """Children, grandchildren... of ``pid``; a process in ``skip`` (on a GPU itself: judged on its
    own) and what is under it are left out."""
    children: dict[int, list[int]] = {}
    for p in processes.values():
        children.setdefault(p.ppid, []).append(p.id)
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child in skip or child == pid:
            continue
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def join(use: Mapping[int, GpuUse], before: CpuSnapshot | None, after: CpuSnapshot | None,
         commands: Mapping[int, str]) -> list[ProcessSummary]:
    """One :class:`ProcessSummary` per pid on a GPU, with CPU figures where both readings have them."""
    out = []
    for pid in sorted(use):
        u = use[pid]
        stat = after.processes.get(pid) if after else None
        # NVML knows pids only: the name too comes from /proc (empty in another PID namespace).
        command = commands.get(pid) or (stat.name if stat else "")
        p = ProcessSummary(pid, command, sorted(u.gpus, key=lambda x: (len(x), x)), u.memory_bytes,
                           u.sm_util, u.gpu_util)
        if before is not None and after is not None and stat is not None:
            t0, t1 = before.at, after.at
            p.cpu = rate(before.processes.get(pid), stat, t0, t1)
            old = before.threads.get(pid, {})
            threads = [TaskSummary(t.id, t.name, r) for t in after.threads.get(pid, {}).values()
                       if (r := rate(old.get(t.id), t, t0, t1)) is not None]
            p.threads = len(after.threads.get(pid, {}))
            p.busiest_thread = max(threads, key=lambda t: t.cpu, default=None)
            workers = []
            for child in descendants(pid, after.processes, skip=use.keys()):
                c = after.processes[child]
                if (r := rate(before.processes.get(child), c, t0, t1)) is not None:
                    workers.append(TaskSummary(child, c.name, r))
            p.workers = sorted(workers, key=lambda w: -w.cpu)[:MAX_WORKERS]
        out.append(p)
    return out
