"""The CPU cost of one region marker in a ``torch.compile``'d model (default mode), on a machine
without a GPU: one source tree, or one against another, interleaved.

    python benchmarks/compile_marker_cpu_bench.py                               # this tree
    python benchmarks/compile_marker_cpu_bench.py --tree /path/to/old --tree .  # old vs new

Under default ``torch.compile`` every marker of a timed pass runs from the Python wrapper code
Inductor emits (``timing/compiled.py``); on CPU Inductor emits the same Python wrapper
(``cpp_wrapper`` off), so the markers' CPU cost is the one a GPU host pays, less CUDA's own record.
The model is a chain of ``--layers`` blocks, each a region (two markers), compiled by Inductor's C++
backend: ``--block linear`` a small ``Linear`` (its output is a buffer anyway), ``--block mlp`` a
pre-norm residual block (LayerNorm, Linear, GELU, Linear, + input), whose output Inductor fuses into
the next block's first kernel unless a marker needs it as a buffer. CUDA is the fake runtime of
``timer_cpu_bench.py`` (a record stamps a counter; the C hot path calls it by address as it calls
libcudart), so the events, the pool, the ring and the recycler are the timer's own.

Each tree runs in fresh processes (``--child``), one a round, trees alternating. In a process the
instrumented model's passes are forced timed or untimed (its sampling state) in interleaved
blocks; per pass it reports the main thread's CPU (``time.thread_time``) as the median over
blocks of: ``untimed_us``, ``timed_us``, ``extra_us`` (their paired difference), and
``per_marker_us`` = (``extra_us`` − ``pass_us``) / markers, where ``pass_us`` is the timed pass's own
bookkeeping outside the markers (``timed_call`` around a callable that does nothing). The report
gives the median over rounds of each, and ``records``: the events the markers record per timed pass
(layers + 1 where each layer's end marker and the next layer's start share one event).

The parts of ``extra_us``: ``inert_us``, a timed pass whose markers do nothing (Inductor's code calls a
no-op instead of ``region_mark_direct``) over an untimed one, so the pass wrapper plus what the
timed graph itself costs more (``graph_us`` = ``inert_us`` − ``pass_us``: buffers and kernels
Inductor adds because a marker needs a value as a buffer); ``markers_us`` = ``extra_us`` −
``inert_us``, the markers' own records and queueing. The resolver runs at its default interval, and
``threads_us`` is what a timed pass adds to the other threads' CPU and to ``flush()`` (each block
ends with one): the resolver thread (``time.pthread_getcpuclockid``), the recycler thread and the
flush, so ``total_us`` = ``extra_us`` + ``threads_us`` is a timed pass's whole extra CPU. GPU figures
come from compile_timing_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchlib import logger, rnd, write_json
from timer_cpu_bench import fake_route, measure_trees, package_root

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("untimed_us", "timed_us", "extra_us", "pass_us", "per_marker_us", "inert_us", "graph_us",
          "markers_us", "threads_us", "total_us")
log = logger("compile-marker-cpu")


def chain(layers: int, kind: str):
    """The model: ``layers`` blocks in a ``ModuleList`` named ``layers``, and an input for it."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(32)
            self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            make = Mlp if kind == "mlp" else (lambda: torch.nn.Linear(8, 8))
            self.layers = torch.nn.ModuleList(make() for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return Chain().eval(), torch.randn(4, 8, 32) if kind == "mlp" else torch.randn(2, 8)


def thread_clock(thread: threading.Thread):
    """A reader of ``thread``'s CPU time (ns)."""
    clock_id = time.pthread_getcpuclockid(thread.ident)
    return lambda: time.clock_gettime_ns(clock_id)


def measure(library: str, layers: int, passes: int, blocks: int, kind: str) -> dict[str, float]:
    import torch

    from gpuscope.timing import Timer

    torch.set_num_threads(1)  # the kernels on this thread, as a GPU's are off it: the others' cores stay free
    pairs = 2 * layers * passes  # events in flight per block at most: room for all of them
    timer = Timer(None, route=fake_route(library, 2 * pairs + 256), sample_rate=1.0,
                  pool_size=2 * pairs + 128, ring_size=pairs + 64, calibrate_every=0)
    try:
        model, x = chain(layers, kind)
        compiled = torch.compile(model)
        # the blocks only (not the mlp's Linear layers inside them)
        inst = timer.instrument(compiled, include=lambda name, module: name.count(".") == 1)
        regions, state = inst.compiled, inst.pass_state
        ops = torch.ops.gpuscope
        direct = ops.region_mark_direct
        clock, resolver = time.thread_time_ns, thread_clock(timer.resolver._thread)
        recycler = lambda: getattr(timer.core.hot, "recycler_cpu_s", 0.0) * 1e9  # noqa: E731

        def block(mode: str) -> tuple[float, float]:
            """Main thread's CPU per pass, and the other threads' (with the flush's)."""
            state.period = 1 if mode != "untimed" else 1 << 40
            state.countdown = 0 if mode != "untimed" else 1 << 40
            if mode == "inert":  # the code Inductor emitted looks the marker up at each call
                ops.region_mark_direct = lambda x, slot: None
            try:
                others = resolver() + recycler()
                t0 = clock()
                for _ in range(passes):
                    compiled(x)
                t1 = clock()
                if not timer.flush(10):
                    raise RuntimeError("pairs left unresolved")
                others = clock() - t1 + resolver() + recycler() - others
            finally:
                ops.region_mark_direct = direct
            return (t1 - t0) / passes / 1e3, others / passes / 1e3

        with torch.no_grad():
            modes = ("timed", "untimed", "inert")
            for _ in range(3):  # compile both graphs, and leave the first timed calls' uncached compiles
                for mode in modes:
                    block(mode)
            # events the markers recorded in the last timed pass (a tree without the count: None)
            block("timed")
            records = getattr(regions.marks, "records", None)
            got: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
            for index in range(blocks):
                for mode in modes if index % 2 == 0 else modes[::-1]:
                    got[mode].append(block(mode))
            nothing = lambda *args, **kwargs: None  # noqa: E731
            t0 = clock()
            for _ in range(2000):
                regions.timed_call(nothing, (x,), {}, None)
            pass_us = (clock() - t0) / 2000 / 1e3
        lost = {reason: n for reason, n in timer.core.dropped.items() if n}
        if lost or regions.stray_marks:
            raise RuntimeError(f"samples lost: {lost}, stray marks {regions.stray_marks}")
        timed, untimed, inert = got["timed"], got["untimed"], got["inert"]
        figures = {"untimed_us": statistics.median(u[0] for u in untimed),
                   "timed_us": statistics.median(t[0] for t in timed),
                   "extra_us": statistics.median(t[0] - u[0] for t, u in zip(timed, untimed, strict=True)),
                   "inert_us": statistics.median(i[0] - u[0] for i, u in zip(inert, untimed, strict=True)),
                   "threads_us": statistics.median(t[1] - u[1] for t, u in zip(timed, untimed, strict=True))}
        markers, extra, inert = 2 * layers, figures["extra_us"], figures["inert_us"]
        return {**figures, "pass_us": pass_us, "per_marker_us": (extra - pass_us) / markers,
                "graph_us": inert - pass_us, "markers_us": extra - inert,
                "total_us": extra + figures["threads_us"], "markers": markers, "records": records}
    finally:
        timer.close(timeout=1.0)


def with_earlier_runs(path: Path, report: dict) -> dict:
    """``{"runs": [report, earlier ones...]}``: what ``path`` held (one report, or a runs list) kept."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"runs": [report]}
    return {"runs": [report, *earlier.get("runs", [earlier])]}


def run_tree(tree: Path, args: argparse.Namespace, library: str) -> dict:
    env_path = str(package_root(tree))
    command = [sys.executable, __file__, "--child", "--library", library, "--layers", str(args.layers),
               "--passes", str(args.passes), "--blocks", str(args.blocks), "--block", args.block]
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
    parser.add_argument("--block", choices=("linear", "mlp"), default="linear",
                        help="what each region is: a Linear, or a pre-norm residual MLP block")
    parser.add_argument("--out", type=Path, help="also write the report here (JSON; a file holding a "
                        "report already keeps it, and earlier ones, in its runs list, newest first)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.rounds, args.layers, args.passes, args.blocks) < 1:
        parser.error("--rounds, --layers, --passes and --blocks must be positive")
    if args.child:
        print(json.dumps(measure(args.library, args.layers, args.passes, args.blocks, args.block)))
        return 0
    runs = measure_trees(parser, args.tree, args.rounds,
                         lambda tree, library: run_tree(tree, args, library), log)
    trees = list(runs)  # as given, the first the old one when two are compared
    medians = {tree: {field: rnd(statistics.median(r[field] for r in rounds), 2) for field in FIELDS}
               for tree, rounds in runs.items()}
    for tree, rounds in runs.items():  # event records per timed pass (the same every round)
        medians[tree]["records"] = rounds[0].get("records")
    report: dict = {"block": args.block, "layers": args.layers, "passes": args.passes, "blocks": args.blocks,
                    "rounds": args.rounds, "markers": 2 * args.layers, "trees": medians}
    print(f"{'tree':<40} " + " ".join(f"{f:>13}" for f in FIELDS))
    for tree, figures in report["trees"].items():
        print(f"{tree[-40:]:<40} " + " ".join(f"{figures[f]:>13}" for f in FIELDS))
    if len(trees) == 2:
        old, new = (report["trees"][tree] for tree in trees)
        report["new_over_old"] = {f: rnd(new[f] / old[f], 3) if old[f] else None
                                  for f in ("extra_us", "per_marker_us", "inert_us", "total_us")}
        print("new / old:", json.dumps(report["new_over_old"]))
    if args.out:
        write_json(args.out, with_earlier_runs(args.out, report), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
