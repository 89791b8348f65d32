"""The timer on a real GPU (skipped without CUDA; the last test needs two)."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from gpuscope.timing import Timer

pytestmark = pytest.mark.gpu
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def registry():
    return CollectorRegistry()


def matmul_times(timer, n=10, size=4096):
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    got = []
    for _ in range(n):
        h = timer.start("mm", on_elapsed=got.append)
        torch.matmul(a, a, out=c)
        timer.stop(h)
    assert timer.flush(30)
    return got


def test_auto_picks_the_ctypes_route_and_times_a_matmul(registry):
    with Timer(registry, sample_rate=1.0) as timer:
        assert timer.route.name == "cudart-ctypes"
        matmul_times(timer, n=2)  # warm-up: cuBLAS set-up would land inside the first region
        got = matmul_times(timer)
        assert len(got) == 10
        assert min(got) > 20e-6 and max(got) < 0.1
        baseline = registry.get_sample_value("gpuscope_timer_baseline_seconds", {"device": "0"})
        assert 0 < baseline < 5e-6, "a queued empty pair costs ~1.3 µs on the GPU (docs/design.md)"


def test_fast_route_agrees_with_torch_events(registry):
    """The same ms-scale matmul behind a busy queue, timed alternately by each route."""
    fast = Timer(registry, sample_rate=1.0, calibrate_every=0)
    slow = Timer(None, backend="torch", sample_rate=1.0, calibrate_every=0)
    try:
        a, b = [], []
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        torch.matmul(x, x, out=y)
        for i in range(20):
            torch.cuda._sleep(1_000_000)  # keep the queue ahead of the CPU
            timer, sink = (fast, a) if i % 2 else (slow, b)
            h = timer.start("mm", on_elapsed=sink.append)
            torch.matmul(x, x, out=y)
            timer.stop(h)
        assert fast.flush(30) and slow.flush(30)
        median_a, median_b = sorted(a)[len(a) // 2], sorted(b)[len(b) // 2]
        assert abs(median_a - median_b) < 0.01 * median_b + 3e-6, (median_a, median_b)
    finally:
        fast.close()
        slow.close()


def test_regions_follow_the_current_stream(registry):
    """A region on a side stream times that stream's work, not the default stream's."""
    with Timer(registry, sample_rate=1.0) as timer:
        side = torch.cuda.Stream()
        x = torch.randn(4096, 4096, device="cuda")
        got = []
        with torch.cuda.stream(side):
            x @ x  # warm-up on this stream
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms busy on the default stream
        with torch.cuda.stream(side):
            h = timer.start("side", on_elapsed=got.append)
            x @ x
            timer.stop(h)
        assert timer.flush(30)
        # On the default stream both records would sit behind the sleep, back to back (~1 µs).
        assert got and 50e-6 < got[0] < 0.04, got


def test_graph_capture_is_left_intact_and_skipped(registry):
    with Timer(registry, sample_rate=1.0, resolve_interval=0.001) as timer:
        x = torch.randn(256, 256, device="cuda")
        # keep the resolver busy during capture: it must not invalidate it (relaxed capture mode)
        stop = threading.Event()

        def producer():
            while not stop.is_set():
                with timer.region("background"):
                    pass

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                y = x @ x
        torch.cuda.current_stream().wait_stream(s)
        t = threading.Thread(target=producer)
        t.start()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph), timer.region("captured"):
                y = x @ x
        finally:
            stop.set()
            t.join()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(y, x @ x, atol=1e-3)
        assert registry.get_sample_value("gpuscope_timer_dropped_samples_total",
                                         {"reason": "graph_capture"}) >= 1
        assert timer.flush(30)


def test_instrument_on_gpu_model(registry):
    with Timer(registry, sample_rate=1.0) as timer:
        layers = (torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))
        model = torch.nn.Sequential(*layers).cuda()
        inst = timer.instrument(model, include=("0", "2"), mode="partition")
        with torch.no_grad():
            for _ in range(5):
                model(torch.randn(64, 512, device="cuda"))
        assert timer.flush(30)
        for op in ("0", "2"):
            labels = {"op": op, "device": "0"}
            assert registry.get_sample_value("gpuscope_region_gpu_seconds_count", labels) == 5
        inst.remove()


def test_close_destroys_events_and_frees_pool(registry):
    timer = Timer(registry, sample_rate=1.0, pool_size=64)
    matmul_times(timer, n=3, size=512)
    timer.close()
    assert timer.core.pools[0] == []
    with timer.region("after-close"):
        torch.ones(1, device="cuda").add_(1)


# What `gpuscope serve --model.device cuda:1` does, in a fresh process: the model is built on cuda:1 from
# the main thread (torch then keeps the runtime on device 1 but reports device 0, lazily), the timer
# is made there too, and an engine thread makes device 1 current and times its steps.
SERVE_ORDER = """
import json, threading, torch
from prometheus_client import CollectorRegistry
from gpuscope.timing import Timer
x = torch.randn(2048, 2048, device="cuda:1")
registry = CollectorRegistry()
timer = Timer(registry, sample_rate=1.0)
y = x @ x  # raises if the timer left a CUDA error in this thread's last-error slot
def engine():
    torch.cuda.set_device(1)
    for _ in range(20):
        with timer.region("mm"):
            torch.matmul(x, x)
thread = threading.Thread(target=engine)
thread.start()
thread.join()
flushed = timer.flush(30)
value = registry.get_sample_value
print(json.dumps({
    "flushed": flushed, "errors": timer.dropped["error"],
    "on_1": value("gpuscope_region_gpu_seconds_count", {"op": "mm", "device": "1"}),
    "on_0": value("gpuscope_region_gpu_seconds_count", {"op": "mm", "device": "0"}),
    "baseline_1": value("gpuscope_timer_baseline_seconds", {"device": "1"}),
    "context_on_0": torch._C._cuda_hasPrimaryContext(0),
}))
timer.close()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_timer_made_before_the_device_is_chosen_times_the_second_gpu():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.run([sys.executable, "-c", SERVE_ORDER], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["flushed"] and got["errors"] == 0, (got, proc.stderr[-2000:])
    assert (got["on_1"], got["on_0"]) == (20, None)
    assert 0 < got["baseline_1"] < 5e-6
    assert got["context_on_0"] is False, "the timer opened a CUDA context on a GPU the program never used"


def test_regions_inside_a_cuda_graph_are_timed_on_sampled_replays(registry):
    """A captured step with instrumented modules: replays give per-module samples, the output is the
    eager one, and back-to-back replays never mix two replays' events (busy copies are skipped)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    model = model.cuda().to(torch.bfloat16).eval()
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    with Timer(registry, sample_rate=1.0, calibrate_every=0) as timer, torch.no_grad():
        inst = timer.instrument(model, include=("0", "2"))
        expected = model(x)
        assert timer.flush(30)
        graph = timer.graph(lambda: model(x), period=2, copies=2)
        assert graph.regions == 2 and graph.baseline_s is not None
        assert timer.flush(30)  # the warm-up's eager regions
        counts = {op: registry.get_sample_value("gpuscope_region_gpu_seconds_count",
                                                {"op": op, "device": "0"}) for op in ("0", "2")}
        # Back to back; each output read (cloned, in stream order) before the next replay, since
        # captures share one memory pool: an output is valid until the next replay.
        outputs = [graph.replay().clone() for _ in range(40)]
        torch.cuda.synchronize()
        assert timer.flush(30)
        assert all(torch.equal(out, expected) for out in outputs)
        for op in ("0", "2"):
            labels = {"op": op, "device": "0"}
            timed = registry.get_sample_value("gpuscope_region_gpu_seconds_count", labels) - counts[op]
            assert 1 <= timed == graph.timed_replays <= 20
        assert graph.timed_replays + timer.dropped["graph_busy"] == 20  # every 2nd replay: timed or busy
        inst.remove()
        graph.close()


@pytest.mark.parametrize(("native", "recycler"), [(True, True), (True, False), (False, False)],
                         ids=["c-hot-path-recycler", "c-hot-path-resolver-loop", "python-hot-path"])
def test_both_hot_paths_time_exact_and_shared_regions_alike(registry, native, recycler):
    """The C hot path records through cudaEventRecord's address, its pairs read by the recycler
    thread or the resolver's C loop; the Python one through ctypes. All time the same matmul regions
    to within 5% of each other's mean."""
    from gpuscope.timing import hot

    if native and not hot.native_available():
        pytest.fail("the C hot path is not built on this GPU host (pip install -e . needs a C compiler)")
    with Timer(registry, sample_rate=1.0, native=native, recycler=recycler) as timer:
        assert timer.core.recycling is recycler
        matmul_times(timer, n=2)
        exact = matmul_times(timer, n=20)
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        seq = timer.sequence()
        for _ in range(10):
            seq.begin()
            seq.split("first")
            a @ a
            seq.split("second")
            a @ a
            seq.end()
        assert timer.flush(30)
        assert timer.dropped["error"] == 0
    counts = {op: registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": "0"})
              for op in ("first", "second")}
    assert counts == {"first": 10, "second": 10}
    sums = {op: registry.get_sample_value("gpuscope_region_gpu_seconds_sum", {"op": op, "device": "0"})
            for op in ("first", "second")}
    mean_exact = sum(exact) / len(exact)
    for op in ("first", "second"):
        assert sums[op] / 10 == pytest.approx(mean_exact, rel=0.05)


def test_kernel_busy_ratio_tells_a_launch_bound_module_from_a_gpu_bound_one():
    """40 tiny kernels launched one by one keep the GPU busy a small share of their region; one
    8192² matmul keeps it busy nearly all of it (benchmarks/kernel_busy_bench.py, asserted)."""
    pytest.importorskip("cupti.cupti", reason="cupti-python is not installed (gpuscope[cupti])")
    spec = importlib.util.spec_from_file_location("kernel_busy_bench", BENCHMARKS / "kernel_busy_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.separation(windows=3, names=("tiny_ops", "matmul_8192"))
    for case in result.values():
        assert case["windows"]["ok"] >= 3 and case["windows"]["failed"] == case["windows"]["timeout"] == 0
    tiny, big = result["tiny_ops"]["busy_ratio_median"], result["matmul_8192"]["busy_ratio_median"]
    assert big > 0.8, result
    assert tiny < 0.6 * big, result
