"""The resolver's C loop (``_hotpath.Resolve``, the path of plain pairs where no recycler runs): the
same observations as the Python loop, through CUDA-shaped C functions (``cuda_shaped.py``), with
unfinished pairs left in order and failures counted."""

import pytest

from gpuscope.timing import Timer, hot, trace
from gpuscope.timing.routes import HostRoute
from tests.timing.conftest import prepared
from tests.timing.cuda_shaped import STEP_MS, CudaShapedRoute


@pytest.fixture
def timer(registry):
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


def time_regions(timer: Timer, exact: int = 3, passes: int = 2) -> None:
    for _ in range(exact):
        with timer.region("exact"):
            pass
    seq = timer.sequence()
    for _ in range(passes):
        seq.begin()
        seq.split("first")
        seq.split("second")
        seq.end()


def test_the_c_loop_observes_what_the_python_loop_does(registry):
    """The same scripted regions resolved by each loop: same counts, buckets, sums and exemplars,
    and every event back in its pool."""
    observed = {}
    for loop in ("c", "python"):
        route = CudaShapedRoute()
        timer = prepared(Timer(None, route=route, sample_rate=1.0, native=True, recycler=False,
                               resolve_interval=3600, pool_size=64))
        assert timer.resolver.fast is not None
        if loop == "python":
            timer.resolver.fast = None
        timer.resolver.baseline_s[0] = 0.0001
        with trace("abc123"):
            time_regions(timer)
        assert timer.flush(5)
        observed[loop] = {op: (h.count, h.counts, round(h.sum, 9), [e and e[:2] for e in h.exemplars])
                          for op in ("exact", "first", "second") if (h := histogram(timer, op))}
        assert len(timer.core.pools[0]) == 64, "an event was not given back"
        timer.close(timeout=1.0)
    assert observed["c"] == observed["python"]
    count, _, total, exemplars = observed["c"]["exact"]
    # 250 µs a region, less the 100 µs baseline; the trace id is the exemplar of its bucket
    assert count == 3 and total == pytest.approx(3 * 150e-6)
    assert ("abc123", pytest.approx(150e-6)) in [e for e in exemplars if e]


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


def test_failed_elapsed_reads_are_counted_and_release_their_events(timer):
    route = timer.route
    errors = timer.dropped["error"]
    route.elapsed_fails = True
    time_regions(timer, exact=3, passes=1)
    assert timer.flush(5)
    assert timer.dropped["error"] - errors == 5  # three exact regions, two in the pass
    assert route.cleared >= 5  # each failure cleared from CUDA's last-error slot
    assert histogram(timer, "exact") is None or histogram(timer, "exact").count == 0
    assert len(timer.core.pools[0]) == 64


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
