"""What one timed region's CPU cost is made of: each call on the hot path, timed alone (idle thread).

    python benchmarks/hot_path_parts.py --out benchmarks/results/hot-path-parts.json
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import ctypes
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch
from benchlib import write_json

from gpuscope.timing import Timer
from gpuscope.timing.routes import CudartCtypesRoute, _loaded_libcudart


def per_call_us(fn, n: int = 20000, reps: int = 5) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter_ns() - t0) / n / 1e3)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="hot-path-parts.json")
    args = parser.parse_args()
    torch.cuda.init()
    route = CudartCtypesRoute()
    ev = route.create()
    stream = torch._C._cuda_getCurrentRawStream(0)
    cdll = ctypes.CDLL(_loaded_libcudart()).cudaEventRecord
    cdll.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    local = threading.local()
    local.stack = []
    var = contextvars.ContextVar("v", default=None)
    ring = collections.deque()
    free = [ev] * 100
    noop = lambda: None  # noqa: E731
    parts = {
        "python_call_noop": noop,
        "getDevice": torch._C._cuda_getDevice,
        "getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "isCurrentStreamCapturing": torch._C._cuda_isCurrentStreamCapturing,
        "record_pydll": lambda: route.record(ev, stream),
        "record_cdll": lambda: cdll(ev, stream),
        "threading_local_attr": lambda: local.stack,
        "contextvar_get": var.get,
        "deque_append_popleft": lambda: (ring.append((1, 2, 3, 4, 5, 6, 7, 8)), ring.popleft()),
        "list_pop_append": lambda: free.append(free.pop()),
    }
    out = {name: per_call_us(fn) for name, fn in parts.items()}
    timer = Timer(None, sample_rate=1.0, pool_size=50000, ring_size=40000)
    region = timer.region("r")

    def with_region():
        with region:
            pass

    out["gpuscope_with_region"] = per_call_us(with_region, n=10000, reps=3)
    timer.flush(30)
    op = timer.op_state("b")

    def begin_end():
        timer.core.end(op, timer.core.begin(op), None)

    out["gpuscope_begin_end"] = per_call_us(begin_end, n=10000, reps=3)
    timer.flush(30)
    seq = timer.sequence()
    ops = [timer.op_state(f"s{i}") for i in range(8)]

    def sequence_pass():
        seq.begin()
        for o in ops:
            seq.split(o)
        seq.end()

    out["gpuscope_sequence_per_region"] = per_call_us(sequence_pass, n=1000, reps=3) / len(ops)
    timer.close()
    write_json(args.out, out, indent=1)
    for name, us in out.items():
        print(f"{name:32s} {us:8.3f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
