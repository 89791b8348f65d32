"""Kernel busy window: does it tell launch-bound modules from GPU-bound ones, and what does it cost?

    pip install 'gpuscope[cupti]'
    python benchmarks/kernel_busy_bench.py --out benchmarks/results/kernel-busy-h200.json   # ~3 min

1. Separation: two instrumented modules, each alone in its model and run after a short idle gap
   so the queue is empty when it starts, with windows as often as the budget allows:
   ``tiny_ops`` (40 elementwise kernels on a 1k-element tensor:
   launch-bound) and ``matmul_4096``/``matmul_8192`` (one bf16 matmul: GPU-bound, the smaller one
   behind a launch gap that is a visible share of it). Reports each module's region
   time, its CUPTI kernel time and the ratio, over several windows.
2. Cost: the 12-layer transformer of timing_bench.py with the default timer (1% budget), window
   off vs on at its default schedule vs forced on every sampled pass, in interleaved paired
   rounds (docs/design.md); plus the CPU cost of one window.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timing_bench, also when imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch
from benchlib import write_json
from timing_bench import Block, progress

from gpuscope.timing import Timer, hot


class TinyOps(torch.nn.Module):
    def forward(self, x):
        for _ in range(40):
            x = x + 1
        return x


class MatMul(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        return x @ self.weight


class Holder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def separation(windows: int, names: tuple[str, ...] = ("tiny_ops", "matmul_4096", "matmul_8192")) -> dict:
    """Busy ratios of modules that are launch-bound or GPU-bound by construction (the GPU tests
    assert on this too)."""
    dev = torch.device("cuda")
    cases = {"tiny_ops": (Holder(TinyOps()), torch.zeros(1024, device=dev)),
             "matmul_4096": (Holder(MatMul(4096)).to(dev, torch.bfloat16),
                             torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)),
             "matmul_8192": (Holder(MatMul(8192)).to(dev, torch.bfloat16),
                             torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16))}
    out = {}
    for name in names:
        model, x = cases[name]
        timer = Timer(None, sample_rate=1.0)
        busy = timer.enable_kernel_busy(min_interval_s=0.0, budget_share=1.0)
        timer.instrument(model, include=("inner",))
        ratios: list[float] = []
        deadline = time.monotonic() + 60
        with torch.no_grad():
            for _ in range(3):
                model(x)
            # Ordinary passes between windows give the module's usual region time (busy.py).
            while len(ratios) < windows and time.monotonic() < deadline:
                torch.cuda.synchronize()
                time.sleep(0.002)  # an idle queue when the module starts, as in a lightly loaded server
                before = busy.windows["ok"]
                model(x)
                torch.cuda.synchronize()
                timer.flush(1.0)
                if busy.windows["ok"] > before:
                    ratios.append(busy.ratios[("inner", "0")])
        hist = timer.core.op_state("inner").hists[0]
        region_us = hist.sum / max(1, hist.count) * 1e6
        out[name] = {"busy_ratio_median": statistics.median(ratios),
                     "busy_ratio_min_max": [min(ratios), max(ratios)],
                     "region_us_mean": region_us, "windows": dict(busy.windows),
                     "window_cpu_ms_mean": busy.cost_s / max(1, busy.windows["ok"]) * 1e3}
        timer.close()
    return out


def cost(rounds: int, iters: int) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    d, layers, heads, bs, seq = 1024, 12, 16, 1, 64
    model = torch.nn.Sequential(*[Block(d, heads) for _ in range(layers)]).to(dev, torch.bfloat16).eval()
    x = torch.randn(bs, seq, d, device=dev, dtype=torch.bfloat16)
    configs = {"window_off": {}, "window_default": {"min_interval_s": 10.0},
               "window_every_sampled_pass": {"min_interval_s": 0.0, "budget_share": 1.0}}
    timers, insts = {}, {}
    for name, options in configs.items():
        timers[name] = Timer(None)
        if name != "window_off":
            timers[name].enable_kernel_busy(**options)
        insts[name] = timers[name].instrument(model, include=("attn", "mlp"))
        insts[name].detach()

    def measure(name: str | None) -> float:
        if name is not None:
            insts[name].attach()
        try:
            with torch.no_grad():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    model(x)
                torch.cuda.synchronize()
                return iters / (time.perf_counter() - t0)
        finally:
            if name is not None:
                insts[name].detach()

    for name in configs:  # warm up, and let each budget controller settle
        for _ in range(3):
            measure(name)
    ratios: dict[str, list[float]] = {name: [] for name in configs}
    for rnd in range(rounds):
        order = list(configs)
        random.Random(rnd).shuffle(order)
        for name in order:
            base = measure(None)
            ratios[name].append(measure(name) / base)
        progress(f"cost: round {rnd + 1}/{rounds}")
    out = {}
    for name in configs:
        busy = timers[name].core.busy
        out[name] = {"loss_pct_median": 100 * (1 - statistics.median(ratios[name])),
                     "loss_pct_min_max": [100 * (1 - max(ratios[name])), 100 * (1 - min(ratios[name]))]}
        if busy is not None:
            out[name].update({"windows": dict(busy.windows), "interval_s": busy.interval_s,
                              "window_cpu_ms_mean": busy.cost_s / max(1, busy.windows["ok"]) * 1e3})
        timers[name].close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="kernel-busy.json")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {"gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "hot_path": "C" if hot.native_available() else "Python"}
    progress("separation: launch-bound vs GPU-bound module")
    out["separation"] = separation(windows=10)
    progress("cost: window off / default / every sampled pass")
    out["cost"] = cost(args.rounds, iters=200)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out, out, indent=1)
    print(f"\nwrote {args.out}\n")
    for name, row in out["separation"].items():
        print(f"{name:12s} busy ratio {row['busy_ratio_median']:.3f}  "
              f"region {row['region_us_mean']:8.1f} µs  "
              f"window CPU {row['window_cpu_ms_mean']:.2f} ms")
    for name, row in out["cost"].items():
        print(f"{name:28s} loss {row['loss_pct_median']:6.2f}%  windows {row.get('windows')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
