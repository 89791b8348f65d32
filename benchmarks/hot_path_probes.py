#!/usr/bin/env python3
"""Probes of what every region timed with shared boundaries costs on the launch-bound workload
(hot_path_bench.py's bs 1 × 64, 24 regions a forward), by hot_path_bench.py's method: blocks of 10
forwards alternating with the untimed model, shuffled order, loss from summed block walls.

``--probe rotation``: does a record cost more when it cycles through many events than when it
re-records one? One record at each region's start (the floor of shared boundaries) with one fixed
event per module, a cycle of 48 and a cycle of 4096; then gpuscope with shared boundaries, with its
resolver, with the resolver held off (drained between blocks, outside the measurement), and with a
512-event pool.

``--probe interval``: shared boundaries against their floor with the resolver's loop and wake-up
interval varied: configurations from timing_bench.py (``_pyresolve``: the resolver's Python loop),
plus ``_ri<ms>``: the resolver waking every that many ms (default 50). Reports the resolver's CPU per
sample.

``--probe recycler``: where shared boundaries lose what they lose beyond one raw record a region:
the recycler thread polling every 0.2, 1 and 10 ms, the resolver's C loop instead of the recycler,
and ``_held``: neither the recycler nor the resolver wakes during a block (both are run between
blocks, outside the measurement), which leaves only the inference thread's own work. Beside the
floor, one raw record a region cycling through 25 events (each module records a different event
each pass, out of a set hardly larger than the fixed one) and through 72 (about what a 10 ms
recycler keeps in flight): whether a record costs more for a new event or for a larger set.
``--probe recycle-interval``: the recycler's poll interval from 1 to 50 ms against the same floor.
``--probe gap``: the default recycler, the floor and the floor cycling through 72 events alone, for
a long run (``--blocks 400``): how much of the gap to the floor the cycling alone accounts for.

    python benchmarks/hot_path_probes.py --probe rotation --out benchmarks/results/event-rotation.json
    python benchmarks/hot_path_probes.py --probe interval --out benchmarks/results/resolve-interval.json
    python benchmarks/hot_path_probes.py --probe recycler --out benchmarks/results/recycler-probe.json
    python benchmarks/hot_path_probes.py --probe recycle-interval --out recycle-interval.json
    python benchmarks/hot_path_probes.py --probe gap --blocks 400 --out benchmarks/results/recycler-gap.json
    python benchmarks/plot_probe_runs.py benchmarks/results/recycler-probe.json ... --out recycler.png
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch
from benchlib import write_json
from hot_path_bench import paired_rounds, recycler_us_per_sample, transformer
from timing_bench import Config

from gpuscope.timing import Timer, hot
from gpuscope.timing.routes import CudartCtypesRoute

PROBES = {
    "rotation": ["raw_fixed", "raw_rot48", "raw_rot4096", "gpuscope_part", "gpuscope_part_noresolve",
                 "gpuscope_part_pool512_noresolve"],
    "interval": ["raw_records", "raw_shared", "gpuscope_full", "gpuscope_full_partition",
                 "gpuscope_full_partition_pyresolve", "gpuscope_full_partition_ri10",
                 "gpuscope_full_partition_ri5"],
    "recycler": ["raw_shared", "raw_rot25", "raw_rot72", "gpuscope_full_partition_recycle200us",
                 "gpuscope_full_partition_recycle1000us", "gpuscope_full_partition_recycle10000us",
                 "gpuscope_full_partition_cresolve", "gpuscope_full_partition_held"],
    "gap": ["raw_shared", "raw_rot72", "gpuscope_full_partition"],
    "recycle-interval": ["raw_shared", *(f"gpuscope_full_partition_recycle{us}us"
                                         for us in (1000, 2000, 5000, 10000, 20000, 50000))],
}
#: Long enough that a held thread never wakes by itself during a run.
HELD_S = 3600.0


class RotationProbe:
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


def interval_config(name: str, mods: list, model: torch.nn.Module) -> Config:
    base, _, interval_ms = name.partition("_ri")
    cfg = Config(base, mods, model, True)
    if interval_ms:
        cfg.timer.close()
        cfg.timer = Timer(None, sample_rate=1.0, resolve_interval=int(interval_ms) / 1000)
    return cfg


class HeldConfig(Config):
    """Shared boundaries with the recycler and the resolver woken only between blocks."""

    def __init__(self, mods: list, model: torch.nn.Module) -> None:
        super().__init__("gpuscope_full_partition", mods, model, True)
        self.timer.close()
        default, hot.RECYCLE_INTERVAL_S = hot.RECYCLE_INTERVAL_S, HELD_S
        try:
            self.timer = Timer(None, sample_rate=1.0, resolve_interval=HELD_S)
        finally:
            hot.RECYCLE_INTERVAL_S = default

    def uninstall(self) -> None:
        super().uninstall()
        self.timer.flush(30)


def recycler_config(name: str, mods: list, model: torch.nn.Module) -> Config | RotationProbe:
    if name.startswith("raw_rot"):
        return RotationProbe(name, mods, model, CudartCtypesRoute())
    return HeldConfig(mods, model) if name.endswith("_held") else Config(name, mods, model, True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", choices=sorted(PROBES), required=True)
    parser.add_argument("--out", default="hot-path-probe.json")
    parser.add_argument("--blocks", type=int, default=150)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model, x, mods = transformer(1, 64)
    names = PROBES[args.probe]
    if args.probe == "rotation":
        route = CudartCtypesRoute()
        cfgs = {name: RotationProbe(name, mods, model, route) for name in names}
    else:
        make = interval_config if args.probe == "interval" else recycler_config
        cfgs = {name: make(name, mods, model) for name in names}
    rounds = paired_rounds(model, x, cfgs, args.blocks, 10, args.probe, warm_up=30)
    out = {"gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "probe": args.probe, "blocks": args.blocks, "configs": {}}
    for name in names:
        row = out["configs"][name] = {"cpu_us_region": rounds.cpu_added_us(name) / len(mods),
                                      "loss_pct": rounds.loss_pct(name)}
        timer = cfgs[name].timer
        if timer is not None:
            timer.flush(10)
            counters = timer.resolver.counters()
            row["resolver_us_per_sample"] = 1e6 * counters["busy"] / max(1, counters["resolved"])
            row["dropped"] = dict(timer.dropped)
            if timer.core.recycling:
                row["recycler_us_per_sample"] = recycler_us_per_sample(timer)
        print(f"{name:36s} cpu/region {row['cpu_us_region']:6.2f} µs  loss {row['loss_pct']:6.2f}%  "
              f"resolver µs/sample {row.get('resolver_us_per_sample', 0):5.2f}", flush=True)
    write_json(args.out, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
