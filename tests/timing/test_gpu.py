"""The timer on a real GPU (run through the device tool; skipped without CUDA)."""

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from gpuscope.timing import Timer

pytestmark = pytest.mark.gpu


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
        assert 0 < baseline < 5e-6, "a queued empty pair costs ~1.3 µs on the GPU (LIMITS.md)"


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
    assert timer._free[0] == []
    with timer.region("after-close"):
        torch.ones(1, device="cuda").add_(1)
