#!/usr/bin/env python3
"""What does ``gpuscope serve --timing`` cost the engine itself, without HTTP? Paired, interleaved rounds.

The HTTP comparison (``compare-h200.md``; README.md, "Load tests and comparisons", gives its
figures) read the default budget several percent below ``--timing off`` from two repetitions whose
pairs disagreed. This runs the server's
real engine, scheduler, model and timer in-process on a saturating closed loop, and per round runs
``off``, ``budget`` and ``all`` back to back (order rotated each round), so each round gives a paired
ratio to ``off``. If the engine alone shows ~0 for the budget while HTTP shows several percent, the
difference is the timer's resolver thread competing for the GIL with the aiohttp loop.

Reported per mode and batch size: tokens/s per round, the median and quartiles of the paired ratio
to ``off``, and the timer's own view (sampling ratio, overhead estimate, drops).

    python benchmarks/server_timing_bench.py --rounds 3 \
        --out benchmarks/results/server-timing-h200-after-fix.json
    python benchmarks/server_timing_bench.py --quick          # CPU smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tenancy_bench's harness

import torch
from benchlib import logger, today, write_json
from benchlib import quartiles as quartiles_of
from prometheus_client import CollectorRegistry
from tenancy_bench import Harness, Size

from gpuscope.contract import catalogue as cat
from gpuscope.server.config import ModelSpec
from gpuscope.server.model import build_model
from gpuscope.server.step_timing import build_timer, instrument_model

progress = logger(None, sys.stdout)  # [HH:MM:SS] lines, on stdout with the report

MODES = ("off", "budget", "all")
TIMER_GAUGES = (cat.TIMER_SAMPLING_RATIO.name, cat.TIMER_OVERHEAD_RATIO.name)


def size_for(model: ModelSpec, batch: int) -> Size:
    return Size(model, batch=batch, prompt_bytes=64, max_tokens=48, share_warmup_s=0, share_window_s=0,
                hi_requests=0, hi_load=1, warmup_s=0, settle_s=0)


def one_run(model, spec: ModelSpec, mode: str, batch: int, warm_s: float, window_s: float) -> dict:
    """Tokens/s of a saturated engine over ``window_s`` after ``warm_s``, with a fresh timer."""
    registry = CollectorRegistry()
    timer = build_timer(mode, registry)
    inst = instrument_model(timer, model) if mode != "off" else None
    harness = Harness(model, timer, size_for(spec, batch), "a:1", "share")
    try:
        harness.start({"a": 2 * batch})
        time.sleep(warm_s + window_s)  # the closed loop runs meanwhile; the window is cut from its steps
        began = time.perf_counter() - window_s
        tokens = sum(sum(counts.values()) for at, _op, _s, counts in harness.steps.rows if at >= began)
    finally:
        harness.stop()
        if inst is not None:
            inst.remove()
        timer.flush(5)
        gauges = {name: [s.value for m in registry.collect() for s in m.samples if s.name == name]
                  for name in TIMER_GAUGES}
        dropped = [s.value for m in registry.collect() for s in m.samples
                   if s.name == cat.TIMER_DROPPED.name]
        timer.close()
    return {"tok_s": tokens / window_s, "errors": harness.errors,
            "timer": {"sampling_ratio_max": max(gauges[TIMER_GAUGES[0]], default=None),
                      "overhead_ratio": max(gauges[TIMER_GAUGES[1]], default=None),
                      "dropped": sum(dropped)}}


def quartiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"median": values[0], "q1": values[0], "q3": values[0]}
    q1, median, q3 = quartiles_of(values)
    return {"median": median, "q1": q1, "q3": q3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=4.0, help="measured seconds per run")
    parser.add_argument("--warm", type=float, default=1.0, help="unmeasured seconds before each window")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke test")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    spec = ModelSpec(layers=6, dim=512, heads=8, context=512)
    if args.quick:
        spec = ModelSpec(layers=1, dim=64, heads=2, context=256)
        args.rounds, args.window, args.warm = 2, 1.0, 0.3
    batches = [int(b) for b in args.batches.split(",")]
    model = build_model(spec)
    device = next(model.parameters()).device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    runs: dict[str, dict[str, list[dict]]] = {str(b): {m: [] for m in MODES} for b in batches}
    started = time.monotonic()
    one_run(model, spec, "budget", batches[-1], args.warm, args.window)  # cold kernels, allocator
    for round_index in range(args.rounds):
        order = MODES[round_index % 3:] + MODES[:round_index % 3]
        for batch in batches:
            for mode in order:
                runs[str(batch)][mode].append(one_run(model, spec, mode, batch, args.warm, args.window))
        progress(f"round {round_index + 1}/{args.rounds} done")

    summary: dict[str, dict] = {}
    for batch, by_mode in runs.items():
        base = [r["tok_s"] for r in by_mode["off"]]
        summary[batch] = {}
        for mode, rows in by_mode.items():
            loss = [100.0 * (1 - r["tok_s"] / b) for r, b in zip(rows, base, strict=True)]
            summary[batch][mode] = {"tok_s": quartiles([r["tok_s"] for r in rows]),
                                    "loss_pct_vs_off": quartiles(loss)}
    report = {"benchmark": "server_timing_bench", "date": today(), "gpu": gpu,
              "torch": torch.__version__, "model": vars(spec), "rounds": args.rounds,
              "window_s": args.window, "warm_s": args.warm, "wall_s": round(time.monotonic() - started, 1),
              "summary": summary, "runs": runs}
    if args.out:
        write_json(args.out, report)
    print(f"\nengine in-process, {gpu}: tokens/s loss vs --timing off (median [q1, q3] of paired rounds)")
    for batch, by_mode in summary.items():
        for mode in MODES[1:]:
            loss = by_mode[mode]["loss_pct_vs_off"]
            tok_s = by_mode[mode]["tok_s"]["median"], by_mode["off"]["tok_s"]["median"]
            print(f"batch {batch:>3} {mode:>7}: {loss['median']:6.2f}% [{loss['q1']:.2f}, {loss['q3']:.2f}]"
                  f"   tok/s {tok_s[0]:.0f} vs {tok_s[1]:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
