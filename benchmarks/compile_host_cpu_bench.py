"""What a timed pass of a ``torch.compile``'d model costs the host, on a machine without a GPU.

    python benchmarks/compile_host_cpu_bench.py --out benchmarks/results/compile-host-cpu.json

A six-layer ``nn.TransformerEncoder`` of width 64 (batch 1 × 2 tokens, so a pass is mostly the
host's work), compiled with Inductor's C++ backend, its layers instrumented with the timer's host
route (CPU timestamps, as on a machine without CUDA); one thread. Blocks of ``--passes`` passes run
interleaved, their order rotating, in each of ``--rounds`` rounds:

- ``detached``: the timer detached from the same compiled model (the baseline);
- ``timed``: every pass timed;
- ``disarmed``: every pass through the timed graph and the sampler's Python, its markers disarmed
  (they record nothing);
- ``caches_every_pass``: every pass timed with Inductor's caches turned off and on again around each
  timed call, as every timed pass on this route did before 2026-12-07 (now only a shape's first
  three: ``compiled.UNCACHED_TIMED_CALLS``).

Per mode the median over rounds of the main thread's CPU a pass, and what it adds to ``detached``.
GPU figures come from compile_timing_bench.py (``--modes parts``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchlib import logger, rnd, write_json
from compile_timing_bench import _Disarmed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
log = logger("compile-host-cpu")
MODES = ("detached", "timed", "disarmed", "caches_every_pass")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--passes", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import torch
    from prometheus_client import CollectorRegistry

    from gpuscope.timing import Timer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).eval()
    x = torch.randn(1, 2, 64)
    timer = Timer(CollectorRegistry(), calibrate_every=0)
    with torch.no_grad():
        compiled = torch.compile(model)
        inst = timer.instrument(compiled, include=lambda name, module: name.count(".") == 1)
        regions, marks = inst.compiled, inst.compiled.marks
        timer.core.fixed_rate = True
        timer.core.set_period(1)
        log("compiling (the untimed graph and its timed twin)")
        for _ in range(10):
            compiled(x)
        first_timed_call = regions._first_timed_call

        def block(mode: str) -> float:
            if mode == "detached":
                inst.detach()
            elif mode == "disarmed":
                regions.marks = _Disarmed(marks)
            elif mode == "caches_every_pass":
                regions._first_timed_call = lambda key: True
            t0 = time.thread_time_ns()
            try:
                for _ in range(args.passes):
                    compiled(x)
            finally:
                per_pass_us = (time.thread_time_ns() - t0) / args.passes / 1e3
                if mode == "detached":
                    inst.attach()
                regions.marks = marks
                regions._first_timed_call = first_timed_call
                timer.flush(10)
            return per_pass_us

        got: dict[str, list[float]] = {m: [] for m in MODES}
        for mode in MODES:  # warm
            block(mode)
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                got[mode].append(block(mode))
            log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {got[m][-1]:.1f} µs" for m in MODES))
    inst.remove()
    timer.close()
    base = statistics.median(got["detached"])
    out = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "passes": args.passes,
           "rounds": args.rounds, "model": "nn.TransformerEncoder, 6 layers, width 64, batch 1 x 2 tokens",
           "modes": {m: {"us_per_pass": rnd(statistics.median(v), 1),
                         "extra_us": rnd(statistics.median(v) - base, 1), "per_round": [rnd(u, 1) for u in v]}
                     for m, v in got.items()}}
    write_json(args.out, out, indent=1)
    print("| mode | CPU µs a pass | over detached |\n|---|---|---|")
    for m in MODES:
        print(f"| {m} | {out['modes'][m]['us_per_pass']} | {out['modes'][m]['extra_us']} |")


if __name__ == "__main__":
    main()
