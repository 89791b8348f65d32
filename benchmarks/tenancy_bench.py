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

Imports only torch, prometheus_client, the standard library and gpuscope (from
``exporter/`` next to this file), so it runs where aiohttp is not installed.

    python benchmarks/tenancy_bench.py --size cpu            # CI-sized smoke, ~1 min on 2 cores
    python benchmarks/tenancy_bench.py --size h200 --out "$OUT/tenancy-h200.json"
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "exporter"))

import torch

from gpuscope.server.config import ModelSpec, parse_tenants
from gpuscope.server.engine import Done, Engine, Failed, Request
from gpuscope.server.model import build_model
from gpuscope.server.scheduler import QueueFull, Scheduler
from gpuscope.server.timer_glue import build_timer


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


SIZES = {
    "cpu": Size(ModelSpec(layers=2, dim=128, heads=4, context=512), batch=8, prompt_bytes=32, max_tokens=24,
                share_warmup_s=1.0, share_window_s=6.0, hi_requests=80, hi_load=0.5),
    "h200": Size(ModelSpec(layers=12, dim=1024, heads=16, context=1024), batch=32, prompt_bytes=256,
                 max_tokens=32, share_warmup_s=3.0, share_window_s=20.0, hi_requests=100, hi_load=0.5),
}

class Harness:
    """One engine + scheduler over the shared model; closed-loop and open-loop load generators."""

    def __init__(self, model, timer, size: Size, tenants: str, mode: str) -> None:
        self.size = size
        self.scheduler = Scheduler(parse_tenants(tenants), mode, max_queue=1 << 16)
        self.closed_loop: dict[str, int] = {}
        self.latencies: dict[str, list[float]] = {}
        self.errors = 0
        self._stop = False
        self.engine = Engine(model, self.scheduler, timer, batch_size=size.batch, max_wait_s=0.002,
                             deliver=self._deliver, log_requests=False)
        self._rng = random.Random(1)

    def request(self, tenant: str) -> Request:
        prompt = bytes(self._rng.randrange(32, 127) for _ in range(self.size.prompt_bytes))
        return Request(tenant, [256, *prompt], self.size.max_tokens, temperature=0.0, trace_id="")

    def _deliver(self, events) -> None:
        for req, event in events:
            if isinstance(event, Done | Failed):
                if isinstance(event, Failed):
                    self.errors += 1
                self.latencies.setdefault(req.tenant, []).append((req.finished_at or 0) - req.arrival)
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
        """Poisson arrivals (a load generator's schedule, not a wait for a condition)."""
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


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def measure_shares(model, timer, size: Size) -> dict:
    harness = Harness(model, timer, size, "a:0.7:normal,b:0.3:normal", "share")
    harness.start({"a": 2 * size.batch, "b": 2 * size.batch})
    time.sleep(size.share_warmup_s)  # run length of the experiment, not a wait for a condition
    timer.flush(5)
    before = harness.scheduler.gpu_seconds()
    time.sleep(size.share_window_s)
    timer.flush(5)
    after = harness.scheduler.gpu_seconds()
    harness.stop()
    used = {t: after[t] - before[t] for t in after}
    total = sum(used.values())
    shares = {t: used[t] / total for t in used}
    error = max(abs(shares["a"] - 0.7), abs(shares["b"] - 0.3)) * 100
    return {"shares": shares, "gpu_seconds": used, "share_error_points": error,
            "window_s": size.share_window_s}


def service_time(model, timer, size: Size) -> float:
    """Median end-to-end time of one request alone (sets the light load's arrival rate)."""
    harness = Harness(model, timer, size, "hi:1:high", "share")
    harness.start({})
    for _ in range(5):
        harness.engine.submit(harness.request("hi"))
        harness.wait_done("hi", len(harness.latencies.get("hi", [])) + 1, 60)
    harness.stop()
    return statistics.median(harness.latencies["hi"])


def measure_priority(model, timer, size: Size, mode: str, flood: bool, gap_s: float) -> float:
    harness = Harness(model, timer, size, "hi:0.5:high,lo:0.5:low", mode)
    harness.start({"lo": 4 * size.batch} if flood else {})
    if flood:
        time.sleep(size.share_warmup_s)  # let the flood fill every slot and queue first
    harness.open_loop("hi", size.hi_requests, gap_s)
    harness.wait_done("hi", size.hi_requests, 300)
    harness.stop()
    return p99(harness.latencies["hi"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES),
                        default="h200" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None,
                        help="JSON path (default $OUT/tenancy-<size>.json, else stdout only)")
    parser.add_argument("--timing", choices=("budget", "all", "off"), default="budget")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    torch.manual_seed(0)
    model = build_model(size.model)
    device = next(model.parameters()).device
    timer = build_timer(args.timing, None)
    started = time.monotonic()
    shares = measure_shares(model, timer, size)
    alone_s = service_time(model, timer, size)
    gap = alone_s / size.hi_load
    hi_alone = measure_priority(model, timer, size, "share", False, gap)
    hi_flood = measure_priority(model, timer, size, "share", True, gap)
    hi_fcfs = measure_priority(model, timer, size, "fcfs", True, gap)
    timer.close()
    result = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (cpu)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
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
            "hi_p99_alone_ms": round(hi_alone * 1e3, 2), "hi_p99_flood_share_ms": round(hi_flood * 1e3, 2),
            "hi_p99_flood_fcfs_ms": round(hi_fcfs * 1e3, 2), "wall_s": round(time.monotonic() - started, 1),
            "torch": torch.__version__,
        },
    }
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], f"tenancy-{args.size}.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
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
