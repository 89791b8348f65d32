"""The resolver's C loop (``_hotpath.Resolve``, the path of plain pairs where no recycler runs),
through CUDA-shaped C functions (``cuda_shaped.py``): unfinished pairs left in order, one query for a
finished stream, pairs with a callback left to Python. That it observes what the other paths do, and
counts failures as they do, is test_observe_paths.py's."""

import pytest

from gpuscope.timing import Timer, hot
from gpuscope.timing.routes import HostRoute
from tests.timing.conftest import prepared, require_native, time_regions
from tests.timing.cuda_shaped import STEP_MS, CudaShapedRoute


@pytest.fixture
def timer(registry):
    require_native()
    route = CudaShapedRoute()
    # A resolver that never wakes by itself: each test drains when it chooses.
    made = prepared(Timer(registry, route=route, sample_rate=1.0, native=True, recycler=False,
                          resolve_interval=3600, pool_size=64))
    made.resolver.baseline_s[0] = 0.0
    assert made.resolver.fast is not None
    yield made
    made.close(timeout=1.0)


def histogram(timer: Timer, op: str):
    return timer.op_state(op).hists.get(0)


def test_unfinished_pairs_wait_in_order_and_are_taken_later(timer):
    route = timer.route
    time_regions(timer, exact=4, passes=0)
    pending = list(timer.core.ring)
    route.not_ready = {pending[2].end, pending[3].end}  # the first two finished, the others not
    assert timer.resolver.drain() == 2
    assert len(timer.core.ring) == 2 and histogram(timer, "exact").count == 2
    route.not_ready = set()
    assert timer.resolver.drain() == 2
    assert histogram(timer, "exact").count == 4 and len(timer.core.pools[0]) == 64


def test_pairs_with_a_callback_go_through_python_between_c_runs(timer):
    charged = []
    with timer.region("before"):
        pass
    handle = timer.start("step", on_elapsed=charged.append)
    timer.stop(handle)
    with timer.region("after"):
        pass
    assert timer.flush(5)
    assert charged == [pytest.approx(STEP_MS * 1e-3)]
    assert [histogram(timer, op).count for op in ("before", "step", "after")] == [1, 1, 1]


def test_without_the_c_hot_path_the_resolver_has_no_c_loop(registry):
    timer = Timer(None, route=CudaShapedRoute(), sample_rate=1.0, native=False)
    try:
        assert timer.resolver.fast is None
    finally:
        timer.close(timeout=1.0)
    assert hot.resolve_loop(HostRoute(), dropped={}, pending_type=tuple) is None


def test_one_query_answers_for_a_stream_whose_last_pair_finished(timer):
    """Events of one stream finish in order, so a finished last pair vouches for the pairs before it:
    one cudaEventQuery per drain here, and one cudaEventElapsedTime per pair."""
    route = timer.route
    time_regions(timer, exact=6, passes=0)
    queries, elapsed = route.queries, route.elapsed_calls
    assert timer.resolver.drain() == 6
    assert (route.queries - queries, route.elapsed_calls - elapsed) == (1, 6)
