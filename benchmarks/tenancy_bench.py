#!/usr/bin/env python3
"""Tenancy targets of ``gpuscope serve``'s scheduler, measured in-process (no HTTP).

Two experiments on the real model, engine, scheduler and timer:

1. Shares: tenants ``a:0.7`` and ``b:0.3`` both saturate the server (closed loop,
   more requests outstanding than batch slots). The GPU seconds charged to each
   tenant (CUDA-event step times split by tokens) are read over the measurement
   window; ``share_error_points`` is the largest gap between measured and
   configured share, in percentage points. Target: ≤ 2.
2. Priority: tenant ``hi`` (high) sends a light open-loop stream; its p99 end-to-end
   latency alone is compared with its p99 while ``lo`` (low) floods the server,
   under share scheduling (``hi_prio_p99_ratio``, target ≤ 1.5) and FCFS
   (``fcfs_hi_prio_p99_ratio``, reported beside it).

A warm-up excluded from every result comes first (every batch size at the phases' widths, then a
throwaway flood + hi run); each priority phase gets a fresh engine, the same pre-roll, the same
seeded arrival schedule and drops its first ``hi_discard`` hi requests alike. ``detail`` carries
what explains a run: step-time statistics, batch rows per tenant, preemptions, GPU seconds per
tenant per phase, the worst hi requests, scheduler accounting and the timer's drop counters.

Imports only torch, prometheus_client, the standard library and gpuscope (from
``src/`` next to this file), so it runs where aiohttp is not installed.

    python benchmarks/tenancy_bench.py --size cpu            # CI-sized smoke, ~1 min on 2 cores
    python benchmarks/tenancy_bench.py --size h200 --out benchmarks/results/tenancy-h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
from benchlib import utc_now, write_json

from gpuscope.server.config import ModelSpec, parse_tenants
from gpuscope.server.engine import Done, Engine, Failed, Request
from gpuscope.server.model import build_model, sample
from gpuscope.server.scheduler import QueueFull, Scheduler
from gpuscope.server.step_timing import build_timer


@dataclass(frozen=True)
class Size:
    model: ModelSpec
    batch: int
    prompt_bytes: int
    max_tokens: int
    share_warmup_s: float
    share_window_s: float
    hi_requests: int
    hi_load: float  # share of one request's service time between hi arrivals (light load)
    warmup_s: float  # throwaway mixed run before anything is measured (cold kernels, allocator, timer)
    settle_s: float  # every priority phase runs this long before its hi stream starts (flood or not)
    hi_discard: int = 4  # first hi requests of every phase, excluded from its percentiles


SIZES = {
    "cpu": Size(ModelSpec(layers=2, dim=128, heads=4, context=512), batch=8, prompt_bytes=32, max_tokens=24,
                share_warmup_s=1.0, share_window_s=6.0, hi_requests=80, hi_load=0.5, warmup_s=1.5,
                settle_s=1.0),
    "h200": Size(ModelSpec(layers=12, dim=1024, heads=16, context=1024), batch=32, prompt_bytes=256,
                 max_tokens=32, share_warmup_s=3.0, share_window_s=20.0, hi_requests=100, hi_load=0.5,
                 warmup_s=4.0, settle_s=2.0),
}


SCHEDULER_OPTIONS: dict = {}  # e.g. join_every, from the command line


class Steps:
    """Every engine step of one phase: (start time, op, host seconds incl. the sync, rows per tenant)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, str, float, dict[str, int]]] = []

    def __call__(self, op: str, batch: list, seconds: float) -> None:
        counts: dict[str, int] = {}
        for req in batch:
            counts[req.tenant] = counts.get(req.tenant, 0) + 1
        self.rows.append((time.perf_counter() - seconds, op, seconds, counts))

    def summary(self, since: float = 0.0) -> dict:
        rows = [r for r in self.rows if r[0] >= since]
        out: dict = {}
        for op in ("prefill", "decode"):
            mine = [r for r in rows if r[1] == op]
            if not mine:
                continue
            ms = sorted(r[2] * 1e3 for r in mine)
            median = statistics.median(ms)
            occupancy: dict[str, float] = {}
            for r in mine:
                for tenant, count in r[3].items():
                    occupancy[tenant] = occupancy.get(tenant, 0.0) + count
            out[op] = {"steps": len(mine), "p50_ms": round(median, 3), "p99_ms": round(pct(ms, 99), 3),
                       "max_ms": round(ms[-1], 2), "slow_steps_over_5x_p50": sum(v > 5 * median for v in ms),
                       "mean_rows_by_tenant": {t: round(v / len(mine), 2)
                                               for t, v in sorted(occupancy.items())}}
        if rows:
            span = rows[-1][0] + rows[-1][2] - rows[0][0]
            out["busy_fraction"] = round(sum(r[2] for r in rows) / span, 3) if span > 0 else None
        return out

    def during(self, req) -> dict:
        """Steps while ``req`` was in the system, and how many of them were other tenants' prefills."""
        rows = [r for r in self.rows if req.arrival <= r[0] <= (req.finished_at or 0.0)]
        return {"steps": len(rows), "step_s": round(sum(r[2] for r in rows), 4),
                "other_prefills": sum(1 for r in rows if r[1] == "prefill" and req.tenant not in r[3])}


class Harness:
    """One engine + scheduler over the shared model; closed-loop and open-loop load generators."""

    def __init__(self, model, timer, size: Size, tenants: str, mode: str) -> None:
        self.size = size
        self.scheduler = Scheduler(parse_tenants(tenants), mode, max_queue=1 << 16, **SCHEDULER_OPTIONS)
        self.closed_loop: dict[str, int] = {}
        self.latencies: dict[str, list[float]] = {}
        self.done: dict[str, list[Request]] = {}
        self.errors = 0
        self.steps = Steps()
        self._stop = False
        self.engine = Engine(model, self.scheduler, timer, batch_size=size.batch, max_wait_s=0.002,
                             deliver=self._deliver, log_requests=False, on_step=self.steps)
        self._rng = random.Random(1)

    def request(self, tenant: str) -> Request:
        prompt = bytes(self._rng.randrange(32, 127) for _ in range(self.size.prompt_bytes))
        return Request(tenant, [256, *prompt], self.size.max_tokens, temperature=0.0, trace_id="")

    def _deliver(self, events) -> None:
        for req, event in events:
            if isinstance(event, Done | Failed):
                if isinstance(event, Failed) and not self._stop:  # not the aborts of stop()
                    self.errors += 1
                self.latencies.setdefault(req.tenant, []).append((req.finished_at or 0) - req.arrival)
                self.done.setdefault(req.tenant, []).append(req)
                if req.tenant in self.closed_loop and not self._stop:
                    self.engine.submit(self.request(req.tenant))  # keep the tenant saturating

    def start(self, closed_loop: dict[str, int]) -> None:
        self.closed_loop = closed_loop
        self.engine.start()
        self.engine.ready.wait(60)
        for tenant, outstanding in closed_loop.items():
            for _ in range(outstanding):
                self.engine.submit(self.request(tenant))

    def open_loop(self, tenant: str, count: int, mean_gap_s: float) -> None:
        """Poisson arrivals (a load generator's schedule, not a wait for a condition); seeded, so
        every phase gets the same schedule."""
        rng = random.Random(7)
        next_at = time.perf_counter()
        for _ in range(count):
            next_at += rng.expovariate(1 / mean_gap_s)
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                self.engine.submit(self.request(tenant))
            except QueueFull:
                self.errors += 1

    def wait_done(self, tenant: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.latencies.get(tenant, [])) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tenant}: {len(self.latencies.get(tenant, []))}/{count} finished")
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop = True
        self.engine.stop(30)


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def p99(values: list[float]) -> float:
    return pct(values, 99)


def timer_state(timer) -> dict:
    return {"sampled": getattr(timer, "sampled", None), "dropped": dict(getattr(timer, "dropped", {}) or {})}


def warm_up(model, timer, size: Size) -> dict:
    """Excluded from every result: each prefill/decode batch size at the widths the phases use
    (cold kernels, allocator growth), then a throwaway flood + hi run (preemption recompute widths,
    the timer's sampling settling), so no phase pays first-use costs the others do not."""
    started = time.perf_counter()
    device = next(model.parameters()).device
    model.allocate_cache(size.batch)
    prompt = size.prompt_bytes + 1
    widths = sorted({prompt, prompt + size.max_tokens // 2, prompt + size.max_tokens - 1})
    with torch.inference_mode():
        for rows in range(1, size.batch + 1):
            slots = torch.arange(rows, device=device)
            zeros = torch.zeros(rows, dtype=torch.long, device=device)
            temps = torch.zeros(rows, device=device)
            for width in widths:
                tokens = torch.full((rows, width), 65, dtype=torch.long, device=device)
                sample(model(tokens, slots, zeros, zeros + width - 1, width), temps).tolist()
                one = torch.full((rows, 1), 65, dtype=torch.long, device=device)
                sample(model(one, slots, zeros + width, zeros, width + 1), temps).tolist()
    sweep_s = time.perf_counter() - started
    harness = Harness(model, timer, size, "hi:0.5:high,lo:0.5:low", "share")
    harness.start({"lo": 4 * size.batch})
    harness.open_loop("hi", 2 * size.hi_discard, size.warmup_s / (2 * size.hi_discard))
    time.sleep(max(0.0, size.warmup_s - (time.perf_counter() - started - sweep_s)))  # run length
    harness.stop()
    timer.flush(5)
    return {"shape_sweep_s": round(sweep_s, 2), "total_s": round(time.perf_counter() - started, 2),
            "steps": len(harness.steps.rows)}


def measure_shares(model, timer, size: Size) -> dict:
    harness = Harness(model, timer, size, "a:0.7:normal,b:0.3:normal", "share")
    harness.start({"a": 2 * size.batch, "b": 2 * size.batch})
    time.sleep(size.share_warmup_s)  # run length of the experiment, not a wait for a condition
    flushed = [timer.flush(5)]
    before = harness.scheduler.diagnostics()
    window_start = time.perf_counter()
    time.sleep(size.share_window_s)
    flushed.append(timer.flush(5))
    after = harness.scheduler.diagnostics()
    window_s = time.perf_counter() - window_start
    harness.stop()
    used = {t: after["gpu_seconds"][t] - before["gpu_seconds"][t] for t in after["gpu_seconds"]}
    total = sum(used.values())
    shares = {t: used[t] / total for t in used}
    error = max(abs(shares["a"] - 0.7), abs(shares["b"] - 0.3)) * 100
    started = {t: after["started"][t] - before["started"][t] for t in used}
    return {"shares": shares, "gpu_seconds": used, "share_error_points": error,
            "window_s": size.share_window_s,
            "diagnostics": {
                "window_s": round(window_s, 2), "timer_flushed_at_window_edges": flushed,
                "requests_started": started,
                # a's virtual time minus b's: bounded when the scheduler holds the shares
                "virtual_time_gap_s": {k: round(d["virtual_time_s"]["a"] - d["virtual_time_s"]["b"], 4)
                                       for k, d in (("start", before), ("end", after))},
                "cost_per_request_s": round(after["cost_per_request_s"], 6),
                "steps_charged": after["steps_charged_provisionally"] - before["steps_charged_provisionally"],
                "measurements_received": after["measurements_received"] - before["measurements_received"],
                "steps": harness.steps.summary(since=window_start), "errors": harness.errors}}


def service_time(model, timer, size: Size) -> float:
    """Median end-to-end time of one request alone (sets the light load's arrival rate)."""
    harness = Harness(model, timer, size, "hi:1:high", "share")
    harness.start({})
    for _ in range(7):
        harness.engine.submit(harness.request("hi"))
        harness.wait_done("hi", len(harness.latencies.get("hi", [])) + 1, 60)
    harness.stop()
    return statistics.median(harness.latencies["hi"][2:])


def measure_priority(model, timer, size: Size, mode: str, flood: bool, gap_s: float) -> dict:
    """One phase on a fresh engine: settle (with or without the flood), then the seeded hi schedule;
    the first ``hi_discard`` hi requests are excluded in every phase alike."""
    harness = Harness(model, timer, size, "hi:0.5:high,lo:0.5:low", mode)
    harness.start({"lo": 4 * size.batch} if flood else {})
    time.sleep(size.settle_s)  # the same pre-roll in every phase (the flood fills every slot)
    timer.flush(5)
    before = harness.scheduler.diagnostics()
    count = size.hi_requests + size.hi_discard
    phase_start = time.perf_counter()
    harness.open_loop("hi", count, gap_s)
    harness.wait_done("hi", count, 300)
    timer.flush(5)
    after = harness.scheduler.diagnostics()
    harness.stop()
    reqs = sorted(harness.done["hi"], key=lambda r: r.arrival)[size.hi_discard:]
    lat = [(r.finished_at or 0) - r.arrival for r in reqs]
    queue = [(r.scheduled_at or r.arrival) - r.arrival for r in reqs]
    worst = sorted(reqs, key=lambda r: (r.finished_at or 0) - r.arrival)[-3:]
    used = {t: round(after["gpu_seconds"][t] - before["gpu_seconds"][t], 4) for t in after["gpu_seconds"]}
    return {
        "p99_s": p99(lat),
        "hi_ms": {"p50": round(pct(lat, 50) * 1e3, 2), "p90": round(pct(lat, 90) * 1e3, 2),
                  "p99": round(p99(lat) * 1e3, 2), "max": round(max(lat) * 1e3, 2),
                  "queue_p99": round(p99(queue) * 1e3, 2)},
        "hi_worst": [{"arrival_s": round(r.arrival - phase_start, 3),
                      "latency_ms": round(((r.finished_at or 0) - r.arrival) * 1e3, 1),
                      "queue_ms": round(((r.scheduled_at or r.arrival) - r.arrival) * 1e3, 1),
                      "tokens": len(r.generated), **harness.steps.during(r)} for r in worst],
        "gpu_seconds": used,
        "preemptions": {t: after["preemptions"][t] - before["preemptions"][t] for t in used},
        "steps": harness.steps.summary(since=phase_start),
        "errors": harness.errors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES),
                        default="h200" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None,
                        help="JSON path (default: the JSON goes to stdout only)")
    parser.add_argument("--timing", choices=("budget", "all", "off"), default="budget")
    parser.add_argument("--join-every", type=int, default=None,
                        help="scheduler's lower-class join pacing (default: the scheduler's own; 1 = none)")
    args = parser.parse_args(argv)
    if args.join_every is not None:
        SCHEDULER_OPTIONS["join_every"] = args.join_every
    size = SIZES[args.size]
    torch.manual_seed(0)
    model = build_model(size.model)
    device = next(model.parameters()).device
    timer = build_timer(args.timing, None)
    started = time.monotonic()
    warm = warm_up(model, timer, size)
    shares = measure_shares(model, timer, size)
    alone_s = service_time(model, timer, size)
    gap = alone_s / size.hi_load
    phases = {name: measure_priority(model, timer, size, mode, flood, gap)
              for name, mode, flood in (("alone", "share", False), ("flood_share", "share", True),
                                        ("flood_fcfs", "fcfs", True))}
    timer.flush(5)
    timer_after = timer_state(timer)
    timer.close()
    hi_alone, hi_flood, hi_fcfs = (phases[n]["p99_s"] for n in ("alone", "flood_share", "flood_fcfs"))
    result = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (cpu)",
        "date": utc_now(),
        "share_error_points": round(shares["share_error_points"], 3),
        "hi_prio_p99_ratio": round(hi_flood / hi_alone, 3),
        "fcfs_hi_prio_p99_ratio": round(hi_fcfs / hi_alone, 3),
        "detail": {
            "size": args.size,
            "model": {k: getattr(size.model, k) for k in ("layers", "dim", "heads", "context")},
            "batch": size.batch, "max_tokens": size.max_tokens, "prompt_bytes": size.prompt_bytes,
            "timing": args.timing, "configured_shares": {"a": 0.7, "b": 0.3},
            "measured_shares": {k: round(v, 4) for k, v in shares["shares"].items()},
            "gpu_seconds": {k: round(v, 4) for k, v in shares["gpu_seconds"].items()},
            "hi_request_alone_s": round(alone_s, 5), "hi_mean_gap_s": round(gap, 5),
            "hi_requests_per_phase": size.hi_requests, "hi_discarded_per_phase": size.hi_discard,
            "hi_p99_alone_ms": round(hi_alone * 1e3, 2), "hi_p99_flood_share_ms": round(hi_flood * 1e3, 2),
            "hi_p99_flood_fcfs_ms": round(hi_fcfs * 1e3, 2), "wall_s": round(time.monotonic() - started, 1),
            "torch": torch.__version__,
            "warm_up_excluded": warm,
            "shares_phase": shares["diagnostics"],
            "priority_phases": {n: {k: v for k, v in p.items() if k != "p99_s"} for n, p in phases.items()},
            "timer": timer_after,
            "scheduler_join_every": Scheduler(parse_tenants("x:1"), **SCHEDULER_OPTIONS).join_every,
        },
    }
    out = args.out
    if out:
        write_json(out, result)
    d = result["detail"]
    print(json.dumps(result, indent=2))
    print(f"\ntenancy ({args.size}, {result['gpu']}, wall {d['wall_s']} s)")
    print(f"{'metric':34s} {'measured':>12s} {'target':>10s}")
    a, b = d["measured_shares"]["a"], d["measured_shares"]["b"]
    print(f"{'share a / b (configured 70/30)':34s} {a:>6.1%} / {b:.1%}")
    print(f"{'share_error_points':34s} {result['share_error_points']:>12.2f} {'<= 2':>10s}")
    print(f"{'hi p99 alone / flood / fcfs (ms)':34s} {d['hi_p99_alone_ms']:.1f} / "
          f"{d['hi_p99_flood_share_ms']:.1f} / {d['hi_p99_flood_fcfs_ms']:.1f}")
    print(f"{'hi_prio_p99_ratio (share)':34s} {result['hi_prio_p99_ratio']:>12.2f} {'<= 1.5':>10s}")
    print(f"{'fcfs_hi_prio_p99_ratio':34s} {result['fcfs_hi_prio_p99_ratio']:>12.2f} {'(report)':>10s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
