"""Verdicts on the processes that hold a GPU: what a box shows with no server to ask.

Each process on a GPU (``Summary.processes``: NVML's record joined with /proc) is judged on its own:

- ``launch_bound`` (problem): its busiest thread is saturated (``saturated_core`` of one core) while
  its GPU is less than ``starved_gpu`` busy. The GPU waits for that thread: a Python
  loop issuing kernels one by one, or preparing input on the thread that launches.
- ``data_loader_bound`` (problem): its GPU is starved the same way while its worker processes
  (descendants holding no GPU: a ``DataLoader``'s workers) are working flat out, each using
  ``worker_saturated`` of a core on average, or together at least ``worker_host_share`` of a
  saturated host's cores. Loading inside the process itself (``num_workers=0``, a thread pool) is
  not told apart from launching: when a thread of it saturates, that is ``launch_bound``, whose next
  step names the loader too.
- ``idle_gpu_holder`` (warning): it holds a GPU but did nothing over the window: SM utilization
  under ``idle_holder_sm`` and CPU, its workers' included, under ``idle_holder_cpu``. A warning: a
  server waiting for requests looks the same as a forgotten notebook.

A process whose GPU is busy (at least ``starved_gpu``) is GPU-bound: no finding. How busy its GPU is
(``ProcessSummary.gpu_busy``) is the higher of its own SM utilization (where NVML keeps per-process
samples) and its GPU's utilization. An idle holder is judged on its own SM utilization, or on the
GPU's when it is alone on that GPU and the driver keeps no per-process samples.
"""

from __future__ import annotations

from gpuscope.diagnose.findings import Finding, Limits
from gpuscope.diagnose.findings import shown as _r
from gpuscope.diagnose.summary import ProcessSummary, Summary


def _gpus(p: ProcessSummary) -> str:
    return ("GPU " if len(p.gpus) == 1 else "GPUs ") + ",".join(p.gpus)


def _launch_bound(p: ProcessSummary, lim: Limits) -> list[Finding]:
    t, busy = p.busiest_thread, p.gpu_busy
    if t is None or busy is None or t.cpu < lim.saturated_core or busy >= lim.starved_gpu:
        return []
    return [Finding(
        "launch_bound", "problem",
        f"launch-bound / host-bound: thread {t.id} ({t.name}) of pid {p.pid} runs at {t.cpu:.0%} of a "
        f"core while {_gpus(p)} is {busy:.0%} busy: the GPU waits for that thread",
        {"pid": p.pid, "command": p.command, "thread_id": t.id, "thread_name": t.name,
         "thread_cpu": _r(t.cpu), "process_cpu": _r(p.cpu), "process_sm_util": _r(p.sm_util),
         "gpu_util": _r(p.gpu_util), "gpus": ",".join(p.gpus)},
        f"see what thread {t.id} runs (py-spy dump --pid {p.pid}); capture the step in a CUDA graph "
        "(torch.compile(model, mode=\"reduce-overhead\"), torch.cuda.graphs) or fuse kernels, raise the "
        "batch size so each launch carries more work, move per-step Python (.item(), logging, metrics) "
        "out of the loop; if that thread loads data (DataLoader num_workers=0), give the loader workers",
        where=f"pid {p.pid}")]


def _data_loader_bound(p: ProcessSummary, s: Summary, lim: Limits) -> list[Finding]:
    busy = p.gpu_busy
    active = [w for w in p.workers if w.cpu >= lim.worker_active]
    if busy is None or busy >= lim.starved_gpu or not active:
        return []
    total = sum(w.cpu for w in active)
    mean = total / len(active)
    host_full = (s.cpu is not None and s.cpu >= lim.input_cpu and s.cpu_cores is not None
                 and total >= lim.worker_host_share * s.cpu_cores)
    if mean < lim.worker_saturated and not host_full:
        return []
    busiest = active[0]
    return [Finding(
        "data_loader_bound", "problem",
        f"data-loader-bound: the {len(active)} worker process(es) of pid {p.pid} use {mean:.0%} of a core "
        f"each{' on a saturated host' if host_full else ''} while {_gpus(p)} is {busy:.0%} busy: the GPU "
        "waits for input",
        {"pid": p.pid, "command": p.command, "workers_active": len(active), "workers_cpu_total": _r(total),
         "worker_cpu_mean": _r(mean), "busiest_worker_pid": busiest.id, "busiest_worker_cpu": _r(busiest.cpu),
         "host_cpu": _r(s.cpu), "process_sm_util": _r(p.sm_util), "gpu_util": _r(p.gpu_util),
         "gpus": ",".join(p.gpus)},
        ("the host has no cores to spare: make each sample cheaper (decode and augment on the GPU, "
         "pre-processed or cached data) or move to a host with more cores" if host_full else
         "more DataLoader workers (num_workers) while cores are free, else make each sample cheaper "
         "(decode and augment on the GPU, pre-processed or cached data)")
        + f"; py-spy top --pid {busiest.id} shows where a worker's time goes",
        where=f"pid {p.pid}")]


def _idle_holder(p: ProcessSummary, s: Summary, lim: Limits) -> list[Finding]:
    if p.cpu is None:
        return []
    sm = p.sm_util
    if sm is None:  # no per-process samples: the GPU's own figure tells only for a lone holder
        shared = any(q.pid != p.pid and set(q.gpus) & set(p.gpus) for q in s.processes)
        sm = None if shared else p.gpu_util
    cpu = p.cpu + sum(w.cpu for w in p.workers)
    if sm is None or sm >= lim.idle_holder_sm or cpu >= lim.idle_holder_cpu:
        return []
    memory = f"{p.memory_bytes / 2**30:.1f} GiB" if p.memory_bytes is not None else "memory"
    return [Finding(
        "idle_gpu_holder", "warning",
        f"{_gpus(p)} held by pid {p.pid} ({memory}) with no activity over the window",
        {"pid": p.pid, "command": p.command, "memory_bytes": _r(p.memory_bytes), "sm_util": _r(sm),
         "cpu": _r(cpu), "gpus": ",".join(p.gpus)},
        f"if pid {p.pid} is not a server waiting for work (a finished job, a forgotten notebook kernel, a "
        f"hung worker: py-spy dump --pid {p.pid}), end it to free the GPU and its memory",
        where=f"pid {p.pid}")]


def judge_processes(s: Summary, lim: Limits) -> list[Finding]:
    """The findings of every process on a GPU, in pid order."""
    out: list[Finding] = []
    for p in s.processes:
        out += _launch_bound(p, lim) + _data_loader_bound(p, s, lim) + _idle_holder(p, s, lim)
    return out
