"""The timer's hot path in context, finely interleaved: C vs Python vs two raw records per region.

    python benchmarks/hot_path_bench.py --out benchmarks/results/hot-path-h200-recycler-10ms.json   # ~2 min

timing_bench.py compares configurations in rounds of a few hundred forwards each; on a shared VM
whose speed drifts by tens of percent within a minute, the per-round ratios scatter too widely to
separate configurations a few percent apart. Here each configuration alternates with the untimed
model in blocks of ``--block`` forwards, many times over, and every forward's CPU time (the main
thread's ``thread_time``) and every block's wall time are kept. Reported per configuration:

- CPU µs added per forward and per region: median forward CPU time minus the untimed median;
- the in-context ratio: that CPU added over raw_records' (the floor: two ctypes records a region);
- throughput loss: 1 - (untimed wall / configuration wall), summed over the paired blocks;
- the resolver's CPU per sample (its loop holds the GIL except, in C, around the CUDA calls), and
  the recycler thread's (which never holds it).

Configurations come from timing_bench.py (24 regions a forward: attention and MLP of 12 blocks):
two raw records a region (the floor of exact regions) and one (``raw_shared``, the floor of shared
boundaries); gpuscope's default budget, every region exact, every region with shared boundaries
(``partition``), both with the resolver's C loop instead of the recycler thread (``_cresolve``),
shared boundaries with the resolver's Python loop (``_pyresolve``), and the Python hot path.
``--configs`` picks a subset (the two raw floors are always run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch
from benchlib import write_json
from timing_bench import Block, Config, progress

from gpuscope.timing import hot

CONFIGS = ["raw_records", "raw_shared", "gpuscope_default", "gpuscope_full", "gpuscope_full_partition",
           "gpuscope_full_cresolve", "gpuscope_full_partition_cresolve", "gpuscope_full_partition_pyresolve",
           "gpuscope_full_python", "gpuscope_full_partition_python"]
#: batch size and sequence length: GPU-bound and launch-bound
WORKLOADS = {"large": (8, 512), "small": (1, 64)}


def run_blocks(model, x, cfg: Config | None, block: int, cpu: list[float]) -> float:
    """``block`` forwards (wall seconds returned, each forward's CPU µs appended to ``cpu``)."""
    if cfg is not None:
        cfg.install()
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(block):
            c0 = time.thread_time_ns()
            model(x)
            cpu.append((time.thread_time_ns() - c0) / 1e3)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:
        if cfg is not None:
            cfg.uninstall()


def transformer(bs: int, seq: int) -> tuple[torch.nn.Module, torch.Tensor, list[tuple[str, torch.nn.Module]]]:
    """timing_bench's 12-block transformer, its input, and its 24 timed modules (attention, MLP)."""
    torch.manual_seed(0)
    d, layers, heads = 1024, 12, 16
    model = torch.nn.Sequential(*[Block(d, heads) for _ in range(layers)]).to("cuda", torch.bfloat16).eval()
    x = torch.randn(bs, seq, d, device="cuda", dtype=torch.bfloat16)
    mods = [(f"{i}.{n}", getattr(b, n)) for i, b in enumerate(model) for n in ("attn", "mlp")]
    return model, x, mods


@dataclasses.dataclass
class Rounds:
    """Per configuration: each forward's CPU µs, untimed (``base_cpu``) and timed, and block walls."""

    base_cpu: dict[str, list[float]]
    cpu: dict[str, list[float]]
    base_wall: dict[str, float]
    wall: dict[str, float]

    def cpu_added_us(self, name: str) -> float:
        return statistics.median(self.cpu[name]) - statistics.median(self.base_cpu[name])

    def loss_pct(self, name: str) -> float:
        return 100 * (1 - self.base_wall[name] / self.wall[name])


def paired_rounds(model: torch.nn.Module, x: torch.Tensor, cfgs: dict, blocks: int, block: int,
                  label: str, warm_up: int = 50) -> Rounds:
    """Each configuration (``install()``/``uninstall()``) alternating with the untimed model, ``blocks``
    rounds in shuffled order."""
    names = list(cfgs)
    rounds = Rounds({n: [] for n in names}, {n: [] for n in names}, dict.fromkeys(names, 0.0),
                    dict.fromkeys(names, 0.0))
    with torch.no_grad():
        for name in names:  # warm-up; lets the default timer's budget controller settle
            run_blocks(model, x, cfgs[name], warm_up, [])
        for i in range(blocks):
            order = list(names)
            random.Random(i).shuffle(order)
            for name in order:
                rounds.base_wall[name] += run_blocks(model, x, None, block, rounds.base_cpu[name])
                rounds.wall[name] += run_blocks(model, x, cfgs[name], block, rounds.cpu[name])
            if (i + 1) % 10 == 0:
                progress(f"{label}: {i + 1}/{blocks} block rounds")
    return rounds


def recycler_us_per_sample(timer) -> float:
    """The recycler thread's CPU µs per sample resolved (it runs beside the GIL, not under it)."""
    return 1e6 * timer.core.hot.recycler_cpu_s / max(1, timer.resolver.counters()["resolved"])


def workload(bs: int, seq: int, blocks: int, block: int, names: list[str]) -> dict:
    model, x, mods = transformer(bs, seq)
    cfgs = {name: Config(name, mods, model, True) for name in names}
    rounds = paired_rounds(model, x, cfgs, blocks, block, f"bs {bs} seq {seq}")
    cpu = rounds.cpu
    out = {}
    for name in names:
        added = rounds.cpu_added_us(name)
        out[name] = {"cpu_us_added_per_forward": added, "cpu_us_added_per_region": added / len(mods),
                     "loss_pct": rounds.loss_pct(name), "forwards": len(cpu[name])}
        timer = cfgs[name].timer
        if timer is not None:
            timer.flush(10)
            out[name]["dropped"] = dict(timer.dropped)
            out[name]["sampling_ratio_final"] = 1 / timer.sampling_period()
            counters = timer.resolver.counters()
            out[name]["resolver_cpu_us_per_sample"] = 1e6 * counters["busy"] / max(1, counters["resolved"])
            out[name]["recycler"] = timer.core.recycling
            if timer.core.recycling:
                out[name]["recycler_cpu_us_per_sample"] = recycler_us_per_sample(timer)
    floor = max(1e-9, out["raw_records"]["cpu_us_added_per_forward"])
    for name in names:
        out[name]["in_context_ratio_to_raw_records"] = out[name]["cpu_us_added_per_forward"] / floor
    for cfg in cfgs.values():
        cfg.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="hot-path.json")
    parser.add_argument("--blocks", type=int, default=100, help="paired block rounds per workload")
    parser.add_argument("--block", type=int, default=10, help="forwards per block")
    parser.add_argument("--configs", default=",".join(CONFIGS[2:]),
                        help="comma-separated configurations besides the two raw floors; a recycler "
                             "configuration may end in _recycle<N>us (its thread's poll interval)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: large, small")
    args = parser.parse_args()
    names = CONFIGS[:2] + [name for name in args.configs.split(",") if name]
    unknown = sorted({re.sub(r"_recycle\d+us$", "", name) for name in names} - set(CONFIGS))
    unknown += sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown configurations or workloads: {', '.join(unknown)} "
                     f"(known: {', '.join(CONFIGS)}; {', '.join(WORKLOADS)})")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {"gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "hot_path_built": hot.native_available(),
           "method": f"blocks of {args.block} forwards alternating untimed/config, {args.blocks} rounds, "
                     "shuffled config order; CPU = median per-forward thread_time difference",
           "workloads": {}}
    for label in args.workloads.split(","):
        bs, seq = WORKLOADS[label]
        out["workloads"][label] = workload(bs, seq, args.blocks, args.block, names)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out, out, indent=1)
    print(f"\nwrote {args.out}\n")
    print(f"{'config':32s} {'loss% L':>8s} {'loss% S':>8s} {'ratio L':>8s} {'ratio S':>8s} {'µs/reg L':>9s} "
          f"{'µs/reg S':>9s}")
    empty = dict.fromkeys(names, dict.fromkeys(("loss_pct", "in_context_ratio_to_raw_records",
                                                 "cpu_us_added_per_region"), float("nan")))
    large, small = out["workloads"].get("large", empty), out["workloads"].get("small", empty)
    for name in names:
        a, b = large[name], small[name]
        ratio = "in_context_ratio_to_raw_records"
        print(f"{name:32s} {a['loss_pct']:8.2f} {b['loss_pct']:8.2f} {a[ratio]:8.2f} {b[ratio]:8.2f} "
              f"{a['cpu_us_added_per_region']:9.2f} "
              f"{b['cpu_us_added_per_region']:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
