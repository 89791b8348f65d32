"""The verdicts: pure functions of a :class:`Summary`, each naming the numbers that triggered it and
the next step.

The three classic patterns (the thresholds of the well-known diagnostic script):

- ``input_bound``: host CPU >= 90% while GPU utilization < 30%: the GPU waits for input
  (tokenization, data loading, pre-processing).
- ``memory_pressure``: a GPU's memory at least as full as the alert rules' memory pressure
  (``bottleneck_memory_ratio``, 90%); with utilization swinging by 30 points or more within the
  window, the allocator is likely thrashing (fragmentation, retries, preemption).
- ``hidden_sync``: host CPU < 40% and GPU utilization < 40% while the server has requests in
  flight: neither side is busy, yet requests wait. With one core saturated it is launch-bound (one
  Python thread feeding the GPU kernel by kernel); otherwise a hidden synchronisation.

Then what the bundle knows beyond them (thresholds shared with the alert rules,
``contract/profiles.py``): ops whose kernels keep the GPU busy less than half their region time
(``launch_bound_ops``), latency that is mostly queueing (``queueing``), preemptions with the KV cache
full (``kv_preemption``), thermal or power throttling, XIDs, and memory that grows throughout
(``memory_leak``).

Last, a server address the user named that did not answer (``server_unreachable``), and what the
processes on the GPUs show without any server (``process_verdicts``: launch-bound, data-loader-bound,
idle holders). Every threshold is in ``findings.Limits``, the rules' in its ``shared``.
"""

from __future__ import annotations

import re

from gpuscope.diagnose.findings import Finding, Limits
from gpuscope.diagnose.findings import shown as _r
from gpuscope.diagnose.process_verdicts import judge_processes
from gpuscope.diagnose.summary import Summary

__all__ = ["Finding", "Limits", "judge"]


def _classic(s: Summary, lim: Limits) -> list[Finding]:
    out: list[Finding] = []
    gpu = s.gpu_util_mean()
    if s.cpu is not None and gpu is not None and s.cpu >= lim.input_cpu and gpu < lim.input_gpu:
        out.append(Finding(
            "input_bound", "problem",
            "input pipeline / tokenization bound: the CPU is saturated, the GPU waits",
            {"host_cpu": _r(s.cpu), "gpu_util": _r(gpu)},
            "profile the CPU side (py-spy top --pid <server>); move tokenization off the serving thread "
            "(more workers, a fast tokenizer, pre-tokenized input) or give the host more cores"))
    for g in s.gpus:
        if g.memory_used_ratio is None or g.memory_used_ratio < lim.shared.bottleneck_memory_ratio:
            continue
        swing = g.util_swing
        swinging = swing is not None and swing >= lim.memory_swing
        out.append(Finding(
            "memory_pressure", "problem" if swinging else "warning",
            "GPU memory nearly full" + (" with utilization swinging: allocator thrashing, fragmentation or "
                                        "preemption" if swinging else ""),
            {"gpu_memory_used": _r(g.memory_used_ratio), "gpu_util_min": _r(g.util_min),
             "gpu_util_max": _r(g.util_max)},
            "find who holds it (nvidia-smi --query-compute-apps=pid,used_memory --format=csv); lower the "
            "batch size or KV-cache share, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against "
            "fragmentation", where=f"gpu {g.label}"))
    srv = s.server
    busy = srv is not None and ((srv.running or 0) >= lim.min_running or (srv.tokens_per_s or 0) > 0)
    if (s.cpu is not None and gpu is not None and s.cpu < lim.idle_cpu and gpu < lim.idle_gpu and busy):
        assert srv is not None
        core = s.cpu_busiest_core
        launch = core is not None and core >= lim.saturated_core
        out.append(Finding(
            "hidden_sync", "problem",
            ("launch-bound: one CPU thread is saturated feeding the GPU kernel by kernel" if launch else
             "hidden synchronisation: CPU and GPU both mostly idle while requests wait"),
            {"host_cpu": _r(s.cpu), "busiest_core": _r(core), "gpu_util": _r(gpu),
             "requests_running": _r(srv.running), "itl_p50_s": _r(srv.itl_p50_s),
             "ttft_p50_s": _r(srv.ttft_p50_s)},
            ("capture the decode step in CUDA graphs (gpuscope serve --model.cuda-graphs), batch more "
             "requests per step, fuse small kernels (torch.compile)" if launch else
             "look for .item(), .cpu(), torch.cuda.synchronize() or blocking copies in the step "
             "(torch.profiler or nsys shows the gaps); check the kernel profile of a slow step")))
    return out


def _bundle(s: Summary, lim: Limits) -> list[Finding]:
    t = lim.shared
    out: list[Finding] = []
    srv = s.server
    if srv is not None:
        slow = {op: o.busy_ratio for op, o in srv.ops.items()
                if o.busy_ratio is not None and o.busy_ratio < t.launch_bound_busy_ratio}
        if slow:
            worst = sorted(slow.items(), key=lambda kv: kv[1])[:5]
            out.append(Finding(
                "launch_bound_ops", "warning",
                f"{len(slow)} op(s) whose kernels keep the GPU busy less than "
                f"{t.launch_bound_busy_ratio:.0%} of their region time: the GPU waits for launches",
                {f"busy_ratio[{op}]": _r(v) for op, v in worst},
                "capture these modules in CUDA graphs or fuse their kernels (torch.compile); larger "
                "batches amortise launches"))
        if ((srv.waiting or 0) >= 1 and srv.queue_p50_s is not None and srv.ttft_p50_s
                and srv.queue_p50_s >= lim.queue_share * srv.ttft_p50_s):
            out.append(Finding(
                "queueing", "problem", "latency is queueing, not compute: requests wait to be scheduled",
                {"requests_waiting": _r(srv.waiting), "queue_p50_s": _r(srv.queue_p50_s),
                 "ttft_p50_s": _r(srv.ttft_p50_s), "requests_running": _r(srv.running)},
                "add replicas or raise the batch size (--batch.max-size); check tenant shares and "
                "per-tenant queue limits"))
        if srv.preemptions:
            full = srv.kv_cache_max is not None and srv.kv_cache_max >= t.kv_cache_full_ratio
            out.append(Finding(
                "kv_preemption", "problem" if full else "warning",
                "requests preempted" + (" with the KV cache full: the cache is too small for the load"
                                        if full else ""),
                {"preemptions": _r(srv.preemptions), "kv_cache_max": _r(srv.kv_cache_max)},
                "raise the KV-cache share (vLLM --gpu-memory-utilization), lower max concurrent "
                "sequences (--max-num-seqs) or shorten max_tokens"))
        if srv.memory_growth_bytes_per_s:
            out.append(Finding(
                "memory_leak", "problem", "the server's memory floor keeps growing",
                {"growth_bytes_per_s": _r(srv.memory_growth_bytes_per_s)},
                "compare torch.cuda.memory_snapshot() over time; look for tensors kept per request "
                "(caches keyed by request, lists of outputs)", where="server"))
    for g in s.gpus:
        for kind, pattern in (("thermal", t.throttle_thermal_reasons), ("power", t.throttle_power_reasons)):
            hits = {r: v for r, v in g.clock_events.items()
                    if re.fullmatch(pattern, r) and v >= t.throttle_ratio}
            if hits:
                out.append(Finding(
                    f"{kind}_throttling", "problem",
                    f"clocks held back by {kind} limits for most of the window",
                    {**{f"active_share[{r}]": _r(v) for r, v in hits.items()},
                     "sm_clock_mhz": _r(g.sm_clock_hz / 1e6 if g.sm_clock_hz else None),
                     "power_w": _r(g.power_w), "power_limit_w": _r(g.power_limit_w)},
                    ("check cooling and airflow (nvidia-smi -q -d TEMPERATURE,PERFORMANCE)"
                     if kind == "thermal" else
                     "check the power limit (nvidia-smi -q -d POWER) and the PSU/rack budget"),
                    where=f"gpu {g.label}"))
        if g.xids:
            critical = {int(c) for c in g.xids if c.isdigit()} & set(t.xid_critical)
            out.append(Finding(
                "xid", "problem",
                "XID errors reported" + (" (hardware / driver: drain the node)" if critical else
                                          " (application faults: the workload's bug)"),
                {f"xid[{code}]": _r(n) for code, n in sorted(g.xids.items())},
                ("drain the GPU and follow NVIDIA's XID catalogue for these codes; the kernel log "
                 "(dmesg | grep -i xid) has the detail" if critical else
                 "read the kernel log (dmesg | grep -i xid) and the server's log around that time: "
                 "an illegal address or a kernel fault in the workload"), where=f"gpu {g.label}"))
        if g.memory_growth_bytes_per_s:
            out.append(Finding(
                "memory_leak", "warning", "GPU memory grew throughout the window",
                {"growth_bytes_per_s": _r(g.memory_growth_bytes_per_s),
                 "gpu_memory_used": _r(g.memory_used_ratio)},
                "watch it over a longer window (gpuscope diagnose --prometheus URL --since 2h) or in "
                "the GPUFramebufferFillingUp alert; find the process with nvidia-smi",
                where=f"gpu {g.label}"))
    return out


def _server_reach(s: Summary) -> list[Finding]:
    """A server the user named that did not answer is what is wrong, not a part left unread: the
    question was about it. (The default address is tried on the chance a server runs there.)"""
    if not s.server_asked or not s.server_failed:
        return []
    evidence: dict[str, float | str] = {"scrapes_failed": s.server_failed, "scrapes": s.server_tried}
    check = (f"check that the server runs and listens there (curl {s.server_asked}), or give the "
             "address it serves /metrics on; --server '' judges the box without a server")
    if s.server is None:
        return [Finding("server_unreachable", "problem",
                        f"server at {s.server_asked} did not answer: {s.server_error}", evidence, check,
                        where="server")]
    return [Finding("server_unreachable", "warning",
                    f"server at {s.server_asked} failed {s.server_failed} of {s.server_tried} scrapes: "
                    f"{s.server_error}", evidence,
                    "look for restarts or stalls in the server's log around the failures; " + check,
                    where="server")]


def judge(summary: Summary, limits: Limits | None = None) -> list[Finding]:
    """Every finding the summary supports, problems first."""
    lim = limits or Limits()
    found = (_classic(summary, lim) + _bundle(summary, lim) + _server_reach(summary)
             + judge_processes(summary, lim))
    return sorted(found, key=lambda f: f.severity != "problem")
