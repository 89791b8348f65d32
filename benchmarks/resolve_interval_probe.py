#!/usr/bin/env python3
"""The launch-bound workload only, many rounds: shared boundaries against their floor, and the
resolver's loop and wake-up interval varied.

    python benchmarks/resolve_interval_probe.py --out benchmarks/results/resolve-interval.json  # ~2 min

Configurations from timing_bench.py (``_pyresolve``: the resolver's Python loop), plus
``_ri<ms>``: gpuscope's C path with the resolver waking every that many ms (default 50). Same method
as hot_path_bench.py; the resolver's CPU per sample is reported with each timer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "exporter"))

import torch
from hot_path_bench import paired_rounds, transformer
from timing_bench import Config

from gpuscope.timing import Timer

CONFIGS = ["raw_records", "raw_shared", "gpuscope_full", "gpuscope_full_partition",
           "gpuscope_full_partition_pyresolve", "gpuscope_full_partition_ri10", "gpuscope_full_partition_ri5"]


def config(name: str, mods: list, model: torch.nn.Module) -> Config:
    base, _, interval_ms = name.partition("_ri")
    cfg = Config(base, mods, model, True)
    if interval_ms:
        cfg.timer.close()
        cfg.timer = Timer(None, sample_rate=1.0, resolve_interval=int(interval_ms) / 1000)
    return cfg


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="resolve-interval.json")
    parser.add_argument("--blocks", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model, x, mods = transformer(1, 64)
    cfgs = {name: config(name, mods, model) for name in CONFIGS}
    rounds = paired_rounds(model, x, cfgs, args.blocks, 10, "resolve interval", warm_up=30)
    out = {}
    for name in CONFIGS:
        row = out[name] = {"cpu_us_region": rounds.cpu_added_us(name) / len(mods),
                           "loss_pct": rounds.loss_pct(name)}
        timer = cfgs[name].timer
        if timer is not None:
            timer.flush(10)
            counters = timer.resolver.counters()
            row["resolver_us_per_sample"] = 1e6 * counters["busy"] / max(1, counters["resolved"])
            row["dropped"] = sum(timer.dropped.values())
        print(f"{name:36s} loss {row['loss_pct']:6.2f}%  resolver µs/sample "
              f"{row.get('resolver_us_per_sample', 0):5.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
