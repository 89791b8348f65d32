"""The CPU cost of one timed region, hot path and resolution, on a machine without a GPU: Python vs C,
and one source tree against another, interleaved.

    python benchmarks/timer_cpu_bench.py                                  # this tree
    python benchmarks/timer_cpu_bench.py --tree /path/to/old --tree .     # old vs new, ratios

CUDA is replaced by a fake runtime compiled here from a few lines of C (``FAKE_CUDA``: a record
stamps a counter into the event, every event has finished, elapsed time is the stamps' difference),
so the C hot path calls it by address as it calls libcudart, the Python hot path through ctypes as
the ``cudart-ctypes`` route does, and the C resolver loop and the recycler thread run without a
Python callback in their way. What is left is gpuscope's own CPU per region, in four paths:

- ``python``: the Python hot path and the resolver's Python loop (where the C extension is not built);
- ``c-python-loop``: the C hot path, the resolver's Python loop (``resolver.fast`` off);
- ``c-loop``: the C hot path and the resolver's C loop (no recycler);
- ``c-recycler``: the C hot path and the recycler thread (the default on a CUDA runtime route).

Each tree runs in fresh processes (``--child``), one a round, trees alternating, every path each
round; per region it reports the main thread's CPU in the ``with region()`` loop (``hot_ns``) and in
``flush()`` (``resolve_ns``), the recycler thread's CPU (``recycler_ns``) and their sum, as the
median over rounds. A tree needs its C extension built (``python setup.py build_ext --inplace``)
for the C paths. GPU figures come from hot_path_bench.py and graph_timing_bench.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import logger, rnd, write_json

ROOT = Path(__file__).resolve().parents[1]
PATHS = {  # name -> (C hot path, recycler, the resolver's C loop)
    "python": (False, False, False),
    "c-python-loop": (True, False, False),
    "c-loop": (True, False, True),
    "c-recycler": (True, True, False),
}
FIELDS = ("hot_ns", "resolve_ns", "recycler_ns", "total_ns")
FAKE_CUDA = r"""
#include <string.h>
static double clock_ms;
int record(void *event, void *stream) {
    (void)stream;
    clock_ms += 0.25;
    memcpy(event, &clock_ms, 8);
    return 0;
}
int query(void *event) { (void)event; return 0; }
int elapsed(float *ms, void *start, void *end) {
    double a, b;
    memcpy(&a, start, 8);
    memcpy(&b, end, 8);
    *ms = (float)(b - a);
    return 0;
}
int last_error(void) { return 0; }
int set_device(int device) { (void)device; return 0; }
int capture_mode(int *mode) { (void)mode; return 0; }
"""
log = logger("timer-cpu")


def build_fake_cuda(folder: str) -> str:
    """The fake runtime as a shared library in ``folder``; its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("timer_cpu_bench: needs a C compiler (cc, gcc or $CC) for the fake CUDA runtime")
    source, library = os.path.join(folder, "fake_cuda.c"), os.path.join(folder, "libfake_cuda.so")
    Path(source).write_text(FAKE_CUDA)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
    return library


def fake_route(library: str, events: int):
    """A route over the fake runtime: events are addresses of 8-byte slots."""
    from gpuscope.timing.routes import HostRoute

    lib = ctypes.CDLL(library)
    functions = {}
    for name, argtypes in (("record", [ctypes.c_void_p, ctypes.c_void_p]), ("query", [ctypes.c_void_p]),
                           ("elapsed", [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]),
                           ("last_error", []), ("set_device", [ctypes.c_int]),
                           ("capture_mode", [ctypes.POINTER(ctypes.c_int)])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        functions[name] = fn

    class FakeCudaRoute(HostRoute):
        name = "fake-cuda"
        on_host = False

        def __init__(self) -> None:
            self.slots = (ctypes.c_double * events)()
            self.made = 0
            self.record = functions["record"]  # as the cudart-ctypes route: a ctypes call on the Python path
            (self.record_address, self.query_address, self.elapsed_address, self.clear_error_address,
             self.set_device_address, self.capture_mode_address) = (
                ctypes.cast(functions[name], ctypes.c_void_p).value
                for name in ("record", "query", "elapsed", "last_error", "set_device", "capture_mode"))

        def create(self) -> int:
            if self.made == events:
                raise RuntimeError("the fake runtime has no event slot left")
            self.made += 1
            return ctypes.addressof(self.slots) + 8 * (self.made - 1)

        def query(self, event: int) -> bool:
            return functions["query"](event) == 0

        def elapsed_s(self, start: int, end: int) -> float:
            ms = ctypes.c_float()
            functions["elapsed"](ctypes.byref(ms), start, end)
            return ms.value * 1e-3

    return FakeCudaRoute()


def measure(library: str, path: str, regions: int, block: int) -> dict[str, float]:
    """Per-region CPU of one path (ns): ``regions`` regions in blocks of ``block``, each block flushed."""
    from gpuscope.timing import Timer

    native, recycler, c_loop = PATHS[path]
    pool = 2 * block + 64
    timer = Timer(None, route=fake_route(library, pool + 64), sample_rate=1.0, native=native,
                  recycler=recycler, resolve_interval=3600, pool_size=pool, ring_size=block + 8,
                  calibrate_every=0)
    try:
        if not c_loop:
            timer.resolver.fast = None
        if (timer.resolver.fast is not None) != c_loop or timer.core.recycling != recycler:
            raise RuntimeError(f"{path}: this tree cannot run that path")
        region, clock = timer.region("op"), time.thread_time_ns
        hot = resolve = 0
        for index in range(regions // block + 1):  # the first block warms up and is left out
            t0 = clock()
            for _ in range(block):
                with region:
                    pass
            t1 = clock()
            if not timer.flush(10):
                raise RuntimeError(f"{path}: pairs left unresolved")
            if index == 0:
                recycler_start = getattr(timer.core.hot, "recycler_cpu_s", 0.0)
                continue
            hot, resolve = hot + t1 - t0, resolve + clock() - t1
        n = block * (regions // block)
        recycler_ns = (getattr(timer.core.hot, "recycler_cpu_s", 0.0) - recycler_start) * 1e9
        observed = timer.op_state("op").hists[0].count
        if observed != n + block:
            raise RuntimeError(f"{path}: {observed} samples for {n + block} regions")
        return {"hot_ns": hot / n, "resolve_ns": resolve / n, "recycler_ns": recycler_ns / n,
                "total_ns": (hot + resolve + recycler_ns) / n}
    finally:
        timer.close(timeout=1.0)


def child(args: argparse.Namespace) -> int:
    from gpuscope.timing import hot

    paths = [p for p in args.paths if hot.native_available() or not PATHS[p][0]]
    out = {path: measure(args.library, path, args.regions, args.block) for path in paths}
    print(json.dumps(out))
    return 0


def package_root(tree: Path) -> Path | None:
    """The folder holding ``gpuscope`` in a source tree (``src/`` or the older ``exporter/``), or None."""
    roots = (tree / "src", tree / "exporter")
    return next((root for root in roots if (root / "gpuscope" / "timing").is_dir()), None)


def measure_trees(parser: argparse.ArgumentParser, tree_args: list[Path] | None, rounds: int,
                  run: Callable[[Path, str], dict], log: Callable[[str], None]) -> dict[str, list[dict]]:
    """``run(tree, fake_library)`` for each source tree (default: this one), ``rounds`` times, the
    trees' order alternating each round (the shared host's speed drifts between rounds)."""
    trees = [tree.resolve() for tree in tree_args or [ROOT]]
    for tree in trees:
        if package_root(tree) is None:
            parser.error(f"--tree {tree}: not a gpuscope source tree (no src/ or exporter/ gpuscope/timing)")
    with tempfile.TemporaryDirectory() as folder:
        library = build_fake_cuda(folder)
        runs: dict[str, list[dict]] = {str(tree): [] for tree in trees}
        for round_index in range(rounds):
            for tree in trees if round_index % 2 == 0 else trees[::-1]:
                runs[str(tree)].append(run(tree, library))
            log(f"round {round_index + 1}/{rounds}")
    return runs


def run_tree(tree: Path, args: argparse.Namespace, library: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package_root(tree))}
    command = [sys.executable, __file__, "--child", "--library", library, "--regions", str(args.regions),
               "--block", str(args.block), "--paths", ",".join(args.paths)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"timer_cpu_bench: {tree}: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", type=Path,
                        help="a source tree to measure (repeat to compare; default: this one)")
    parser.add_argument("--rounds", type=int, default=7, help="processes per tree, trees alternating")
    parser.add_argument("--regions", type=int, default=20000, help="timed regions per path per round")
    parser.add_argument("--block", type=int, default=500, help="regions between two flushes")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--out", type=Path, help="also write the report here (JSON)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown or not args.paths:
        parser.error(f"--paths: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(PATHS)}")
    if min(args.rounds, args.regions, args.block) < 1 or args.regions < args.block:
        parser.error("--rounds, --regions and --block must be positive, and --regions at least --block")
    if args.child:
        return child(args)
    runs = measure_trees(parser, args.tree, args.rounds,
                         lambda tree, library: run_tree(tree, args, library), log)
    trees = list(runs)  # as given, the first the old one when two are compared
    report: dict = {"regions": args.regions, "block": args.block, "rounds": args.rounds, "trees": {}}
    for tree, rounds in runs.items():
        report["trees"][tree] = {path: {field: rnd(statistics.median(r[path][field] for r in rounds), 1)
                                        for field in FIELDS} for path in args.paths if path in rounds[0]}
    print(f"{'tree':<40} {'path':<15} " + " ".join(f"{f:>12}" for f in FIELDS))
    for tree, paths in report["trees"].items():
        for path, figures in paths.items():
            print(f"{tree[-40:]:<40} {path:<15} " + " ".join(f"{figures[f]:>12}" for f in FIELDS))
    if len(trees) == 2:
        old, new = (report["trees"][tree] for tree in trees)
        report["new_over_old"] = {path: {f: rnd(new[path][f] / old[path][f], 3) if old[path][f] else None
                                         for f in ("hot_ns", "resolve_ns", "total_ns")}
                                  for path in new if path in old}
        print("new / old:", json.dumps(report["new_over_old"]))
    for tree, paths in report["trees"].items():
        if "python" in paths:
            report.setdefault("python_over_c", {})[tree] = {
                path: rnd(paths["python"]["total_ns"] / figures["total_ns"], 2)
                for path, figures in paths.items() if path != "python"}
    print("python / C (total per region):", json.dumps(report.get("python_over_c", {})))
    if args.out:
        write_json(args.out, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
