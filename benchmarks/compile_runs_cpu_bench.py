"""What sampled passes cost a ``torch.compile``'d model (default mode) at a budget-like period, one
timed pass at a time against runs of timed passes, on a machine without a GPU.

    python benchmarks/compile_runs_cpu_bench.py --out benchmarks/results/compile-runs-cpu.json

A sampled pass switches the compiled model to its timed graph and the next untimed pass back
(``timing/compiled.py``, ``TIMED_RUN``). The model and the fake CUDA runtime are those of
``compile_marker_cpu_bench.py`` (a chain of pre-norm residual MLP blocks, each a region; a record
stamps a counter). In each process, blocks of ``--passes`` passes run interleaved, their order
alternating: ``detached`` (the timer detached from the same compiled model: the baseline), ``untimed``
(attached, never sampled), ``every`` (every pass timed) and, for each ``--runs`` length N, ``runN``
(sampled at ``--period``, in runs of N). Per block the main thread's CPU per pass (and, as
``*_wall_us``, its wall time); per mode the
median over blocks of its paired difference from ``detached`` (``extra_us``), then the median over
``--rounds`` processes. The ideal at the period is ``untimed`` + ``every`` ÷ period: what is above it
is the switching. Per run mode also the budget's own estimate of a timed pass's cost over an untimed
one (``runN_estimate_us``, measured in the program from each block's passes; ``runN_wall_estimate_us`` on
the wall clock) against what it cost
all told (``runN_actual_us``: its extra over ``untimed``, times the period). GPU figures come from
compile_timing_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import logger, rnd, write_json
from compile_marker_cpu_bench import chain
from timer_cpu_bench import build_fake_cuda, fake_route

ROOT = Path(__file__).resolve().parents[1]
log = logger("compile-runs-cpu")


def measure(library: str, layers: int, passes: int, blocks: int, period: int, runs: list[int]) -> dict:
    import torch

    import gpuscope.timing.compiled as compiled_mod
    from gpuscope.timing import Timer

    torch.set_num_threads(1)
    pairs = 2 * layers * passes
    timer = Timer(None, route=fake_route(library, 2 * pairs + 256), sample_rate=1.0,
                  pool_size=2 * pairs + 128, ring_size=pairs + 64, calibrate_every=0)
    try:
        model, x = chain(layers, "mlp")
        compiled = torch.compile(model)
        inst = timer.instrument(compiled, include=lambda name, module: name.count(".") == 1)
        state, clock = inst.pass_state, time.thread_time_ns

        estimates: dict[str, list[float]] = {}

        def block(mode: str) -> tuple[float, float]:
            sampled = mode.startswith("run")
            if sampled:
                compiled_mod.TIMED_RUN = int(mode[3:])
                inst.cost.__init__()  # the budget's estimate from this block's passes alone
                inst.wall_cost.__init__()
            state.period = period if sampled else 1 if mode == "every" else 1 << 40
            state.countdown = 0 if sampled or mode == "every" else 1 << 40
            if mode == "detached":
                inst.detach()
            try:
                t0, w0 = clock(), time.perf_counter_ns()
                for _ in range(passes):
                    compiled(x)
                spent, spent_wall = clock() - t0, time.perf_counter_ns() - w0
            finally:
                if mode == "detached":
                    inst.attach()
            if not timer.flush(10):
                raise RuntimeError("pairs left unresolved")
            for key, cost in (("", inst.cost), ("_wall", inst.wall_cost)):
                estimate = cost.per_sampled_pass_s() if sampled else None
                if estimate is not None:
                    estimates.setdefault(mode + key, []).append(estimate * 1e6)
            return spent / passes / 1e3, spent_wall / passes / 1e3

        modes = ["detached", "untimed", "every", *(f"run{n}" for n in runs)]
        with torch.no_grad():
            for _ in range(3):  # both graphs compiled, the first timed calls' uncached compiles done
                for mode in modes:
                    block(mode)
            got: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
            for index in range(blocks):
                for mode in modes if index % 2 == 0 else modes[::-1]:
                    got[mode].append(block(mode))
        out: dict[str, float] = {}
        for index, key in enumerate(("", "_wall")):  # the thread's CPU, then the wall clock
            base = [b[index] for b in got["detached"]]
            out[f"detached{key}_us"] = statistics.median(base)
            for mode in modes[1:]:
                out[f"{mode}_extra{key}_us"] = statistics.median(
                    a[index] - b for a, b in zip(got[mode], base, strict=True))
        # what the in-program measurement says a timed pass costs over an untimed one: the thread's CPU
        # (what the budget reads) and the wall clock (``inst.wall_cost``)
        out.update({f"{mode}_estimate_us": statistics.median(values) for mode, values in estimates.items()})
        return out
    finally:
        timer.close(timeout=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="processes, each measuring every mode")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--passes", type=int, default=320, help="passes per block")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per mode per process")
    parser.add_argument("--period", type=int, default=20, help="the sampling period of the run modes")
    parser.add_argument("--runs", default="1,4,8", help="run lengths to compare")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the fake runtime's path
    args = parser.parse_args(argv)
    runs = [int(n) for n in args.runs.split(",")]
    if min(args.rounds, args.layers, args.passes, args.blocks, args.period, *runs) < 1:
        parser.error("--rounds, --layers, --passes, --blocks, --period and --runs must be positive")
    if args.child:
        print(json.dumps(measure(args.child, args.layers, args.passes, args.blocks, args.period, runs)))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as folder:
        library = build_fake_cuda(folder)
        command = [sys.executable, __file__, "--child", library, "--layers", str(args.layers), "--passes",
                   str(args.passes), "--blocks", str(args.blocks), "--period", str(args.period),
                   "--runs", args.runs]
        for index in range(args.rounds):
            done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                                  capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"compile_runs_cpu_bench: {done.stderr.strip().splitlines()[-3:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            shown = ", ".join(f"{k} {v:.2f}" for k, v in results[-1].items())
            log(f"round {index + 1}/{args.rounds}: {shown}")
    medians = {key: rnd(statistics.median(r[key] for r in results), 2) for key in results[0]}
    medians["ideal_extra_us"] = rnd(medians["untimed_extra_us"] + medians["every_extra_us"] / args.period, 2)
    for n in runs:  # what a timed pass cost over an untimed one, all told: the estimate's target
        for key in ("", "_wall"):
            medians[f"run{n}_actual{key}_us"] = rnd(
                (medians[f"run{n}_extra{key}_us"] - medians[f"untimed_extra{key}_us"]) * args.period, 1)
    report = {"date": time.strftime("%Y-%m-%d"), "layers": args.layers, "passes": args.passes,
              "blocks": args.blocks, "period": args.period, "rounds": args.rounds, "medians": medians,
              "per_round": results}
    print(json.dumps(medians, indent=1))
    if args.out:
        write_json(args.out, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
