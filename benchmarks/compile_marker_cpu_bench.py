"""The CPU cost of one region marker in a ``torch.compile``'d model (default mode), on a machine
without a GPU: one source tree, or one against another, interleaved.

    python benchmarks/compile_marker_cpu_bench.py                               # this tree
    python benchmarks/compile_marker_cpu_bench.py --tree /path/to/old --tree .  # old vs new

Under default ``torch.compile`` every marker of a timed pass runs from the Python wrapper code
Inductor emits (``timing/compiled.py``); on CPU Inductor emits the same Python wrapper
(``cpp_wrapper`` off), so the markers' CPU cost is the one a GPU host pays, less CUDA's own record.
The model is a chain of ``--layers`` small ``Linear`` layers, each a region (two markers), compiled
by Inductor's C++ backend. CUDA is the fake runtime of ``timer_cpu_bench.py`` (a record stamps a
counter; the C hot path calls it by address as it calls libcudart), so the events, the pool, the
ring and the recycler are the timer's own.

Each tree runs in fresh processes (``--child``), one a round, trees alternating. In a process the
instrumented model's passes are forced timed or untimed (its sampling state) in interleaved
blocks; per pass it reports the main thread's CPU (``time.thread_time``) as the median over
blocks of: ``untimed_us``, ``timed_us``, ``extra_us`` (their paired difference), and
``per_marker_us`` = (``extra_us`` − ``pass_us``) / markers, where ``pass_us`` is the timed pass's own
bookkeeping outside the markers (``timed_call`` around a callable that does nothing). The report
gives the median over rounds of each, and ``records``: the events the markers record per timed pass
(layers + 1 where each layer's end marker and the next layer's start share one event). GPU figures
come from compile_timing_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import logger, rnd, write_json
from timer_cpu_bench import fake_route, measure_trees, package_root

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("untimed_us", "timed_us", "extra_us", "pass_us", "per_marker_us")
log = logger("compile-marker-cpu")


def measure(library: str, layers: int, passes: int, blocks: int) -> dict[str, float]:
    import torch

    from gpuscope.timing import Timer

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    pairs = 2 * layers * passes  # events in flight per block at most: room for all of them
    timer = Timer(None, route=fake_route(library, 2 * pairs + 256), sample_rate=1.0,
                  pool_size=2 * pairs + 128, ring_size=pairs + 64, resolve_interval=3600, calibrate_every=0)
    try:
        torch.manual_seed(0)
        compiled = torch.compile(Chain().eval())
        inst = timer.instrument(compiled, include=("layers.*",))
        regions, state = inst.compiled, inst.pass_state
        x = torch.randn(2, 8)
        clock = time.thread_time_ns

        def block(timed: bool) -> float:
            state.period = 1 if timed else 1 << 40
            state.countdown = 0 if timed else 1 << 40
            t0 = clock()
            for _ in range(passes):
                compiled(x)
            elapsed = (clock() - t0) / passes / 1e3
            if not timer.flush(10):
                raise RuntimeError("pairs left unresolved")
            return elapsed

        with torch.no_grad():
            for _ in range(3):  # compile both graphs, and leave the first timed calls' uncached compiles
                block(True)
                block(False)
            # events the markers recorded in the last timed pass (a tree without the count: None)
            records = getattr(regions.marks, "records", None)
            timed, untimed = [], []
            for index in range(blocks):
                order = (True, False) if index % 2 == 0 else (False, True)
                for mode in order:
                    (timed if mode else untimed).append(block(mode))
            nothing = lambda *args, **kwargs: None  # noqa: E731
            t0 = clock()
            for _ in range(2000):
                regions.timed_call(nothing, (x,), {}, None)
            pass_us = (clock() - t0) / 2000 / 1e3
        lost = {reason: n for reason, n in timer.core.dropped.items() if n}
        if lost or regions.stray_marks:
            raise RuntimeError(f"samples lost: {lost}, stray marks {regions.stray_marks}")
        extra = statistics.median(t - u for t, u in zip(timed, untimed, strict=True))
        markers = 2 * layers
        return {"untimed_us": statistics.median(untimed), "timed_us": statistics.median(timed),
                "extra_us": extra, "pass_us": pass_us, "per_marker_us": (extra - pass_us) / markers,
                "markers": markers, "records": records}
    finally:
        timer.close(timeout=1.0)


def run_tree(tree: Path, args: argparse.Namespace, library: str) -> dict:
    env_path = str(package_root(tree))
    command = [sys.executable, __file__, "--child", "--library", library, "--layers", str(args.layers),
               "--passes", str(args.passes), "--blocks", str(args.blocks)]
    result = subprocess.run(command, env={**os.environ, "PYTHONPATH": env_path},
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"compile_marker_cpu_bench: {tree}: {result.stderr.strip().splitlines()[-3:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", type=Path,
                        help="a source tree to measure (repeat to compare; default: this one)")
    parser.add_argument("--rounds", type=int, default=5, help="processes per tree, trees alternating")
    parser.add_argument("--layers", type=int, default=24, help="regions in the model (two markers each)")
    parser.add_argument("--passes", type=int, default=100, help="passes per block")
    parser.add_argument("--blocks", type=int, default=16, help="timed and untimed blocks per process, each")
    parser.add_argument("--out", type=Path, help="also write the report here (JSON)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.rounds, args.layers, args.passes, args.blocks) < 1:
        parser.error("--rounds, --layers, --passes and --blocks must be positive")
    if args.child:
        print(json.dumps(measure(args.library, args.layers, args.passes, args.blocks)))
        return 0
    runs = measure_trees(parser, args.tree, args.rounds,
                         lambda tree, library: run_tree(tree, args, library), log)
    trees = list(runs)  # as given, the first the old one when two are compared
    medians = {tree: {field: rnd(statistics.median(r[field] for r in rounds), 2) for field in FIELDS}
               for tree, rounds in runs.items()}
    for tree, rounds in runs.items():  # event records per timed pass (the same every round)
        medians[tree]["records"] = rounds[0].get("records")
    report: dict = {"layers": args.layers, "passes": args.passes, "blocks": args.blocks,
                    "rounds": args.rounds, "markers": 2 * args.layers, "trees": medians}
    print(f"{'tree':<40} " + " ".join(f"{f:>14}" for f in FIELDS))
    for tree, figures in report["trees"].items():
        print(f"{tree[-40:]:<40} " + " ".join(f"{figures[f]:>14}" for f in FIELDS))
    if len(trees) == 2:
        old, new = (report["trees"][tree] for tree in trees)
        report["new_over_old"] = {f: rnd(new[f] / old[f], 3) if old[f] else None
                                  for f in ("extra_us", "per_marker_us")}
        print("new / old:", json.dumps(report["new_over_old"]))
    if args.out:
        write_json(args.out, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
