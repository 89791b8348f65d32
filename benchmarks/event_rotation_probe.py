#!/usr/bin/env python3
"""Does a record cost more when it cycles through many events than when it re-records one?

    python benchmarks/event_rotation_probe.py --out benchmarks/results/event-rotation.json   # ~1 min

The launch-bound workload of hot_path_bench.py (bs 1 × 64, 24 regions a forward) with one record
at each region's start (the floor of shared boundaries), the event taken three ways: one fixed
event per module, a cycle of 48 and a cycle of 4096; then gpuscope with shared boundaries, with
its resolver and with the resolver held off (drained between blocks, outside the measurement),
and with a 512-event pool. Same method as hot_path_bench.py: blocks of 10 forwards alternating
with the untimed model, shuffled order, loss from summed block walls.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "exporter"))

import torch
from hot_path_bench import paired_rounds, transformer

from gpuscope.timing import Timer
from gpuscope.timing.routes import CudartCtypesRoute

CONFIGS = ["raw_fixed", "raw_rot48", "raw_rot4096", "gpuscope_part", "gpuscope_part_noresolve",
           "gpuscope_part_pool512_noresolve"]


class Probe:
    """One way of putting a record at each module's start (install/uninstall around a block)."""

    def __init__(self, name: str, mods: list, model: torch.nn.Module, route: CudartCtypesRoute) -> None:
        self.name, self.mods, self.model, self.route = name, mods, model, route
        self.timer: Timer | None = None
        self.inst = None
        if name == "raw_fixed":
            self.events = [itertools.repeat(route.create()) for _ in mods]
        elif name.startswith("raw_rot"):
            cycle = itertools.cycle([route.create() for _ in range(int(name.removeprefix("raw_rot")))])
            self.events = [cycle] * len(mods)
        else:
            interval = 3600.0 if "noresolve" in name else 0.05
            self.timer = Timer(None, sample_rate=1.0, resolve_interval=interval,
                               pool_size=512 if "pool512" in name else 4096)

    def install(self) -> None:
        if self.timer is not None:
            if self.inst is None:
                self.inst = self.timer.instrument(self.model, include=("attn", "mlp"), mode="partition")
            else:
                self.inst.attach()
            return
        record, stream_of = self.route.record, torch._C._cuda_getCurrentRawStream
        for (_, module), events in zip(self.mods, self.events, strict=True):
            def forward(*args, _original=module.forward, _next=events.__next__, **kwargs):
                record(_next(), stream_of(0))
                return _original(*args, **kwargs)
            module.forward = forward

    def uninstall(self) -> None:
        if self.inst is not None:
            self.inst.detach()
            if "noresolve" in self.name:
                self.timer.flush(30)
        for _, module in self.mods:
            module.__dict__.pop("forward", None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="event-rotation.json")
    parser.add_argument("--blocks", type=int, default=120)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model, x, mods = transformer(1, 64)
    route = CudartCtypesRoute()
    probes = {name: Probe(name, mods, model, route) for name in CONFIGS}
    rounds = paired_rounds(model, x, probes, args.blocks, 10, "event rotation", warm_up=30)
    out = {"gpu": torch.cuda.get_device_name(0), "configs": {}}
    for name in CONFIGS:
        row = out["configs"][name] = {"cpu_us_region": rounds.cpu_added_us(name) / len(mods),
                                      "loss_pct": rounds.loss_pct(name)}
        if probes[name].timer is not None:
            row["dropped"] = dict(probes[name].timer.dropped)
        print(f"{name:34s} cpu/region {row['cpu_us_region']:6.2f} µs  loss {row['loss_pct']:6.2f}%",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
