"""The C hot path's recycler: a thread without the GIL reads finished pairs and gives their events
back at once, and the resolver only collects the elapsed times into histograms. Driven through
CUDA-shaped callbacks (``cuda_shaped.py``); every wait is a recycler pass or a flush with a deadline."""

import pytest

from gpuscope.timing import Timer
from tests.timing.conftest import prepared, require_native, time_regions
from tests.timing.cuda_shaped import STEP_MS, CudaShapedRoute

POOL = 64


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native()


def make(route: CudaShapedRoute | None = None, **kwargs) -> Timer:
    # A resolver that never wakes by itself: each test collects when it chooses.
    return prepared(Timer(None, route=route or CudaShapedRoute(), sample_rate=1.0, native=True,
                          resolve_interval=3600, pool_size=POOL, **kwargs))


@pytest.fixture
def timer():
    made = make()
    made.resolver.baseline_s[0] = 0.0
    assert made.core.recycling and made.resolver.fast is None
    yield made
    made.close(timeout=1.0)


def histogram(timer: Timer, op: str, device: int = 0):
    return timer.op_state(op).hists.get(device)


def test_unfinished_pairs_wait_in_order_and_keep_their_events(timer):
    route = timer.core.route
    route.gpu_ms = route.clock_ms + 4 * STEP_MS  # the GPU will have reached the end of the second region
    time_regions(timer, exact=4, passes=0)
    assert timer.core.hot.recycle_pass(5.0)
    assert timer.resolver.drain() == 2
    assert timer.core.pending() == 2 and histogram(timer, "exact").count == 2
    assert len(timer.core.pools[0]) == POOL - 4, "events of unfinished pairs came back"
    route.gpu_ms = float("inf")
    assert timer.flush(5)
    assert histogram(timer, "exact").count == 4 and len(timer.core.pools[0]) == POOL


def test_events_come_back_to_be_recorded_again_next(timer):
    """The point of the recycler: regions resolved as they go re-record the same two events, not
    the whole pool in turn (on a GPU, a record on an event used a moment ago is the cheap one)."""
    route = timer.core.route
    before = set(route.stamps)
    for _ in range(20):
        with timer.region("exact"):
            pass
        assert timer.core.hot.recycle_pass(5.0)
    assert timer.flush(5)
    assert histogram(timer, "exact").count == 20
    assert len(set(route.stamps) - before) == 2
    assert len(timer.core.pools[0]) == POOL


def test_pairs_with_a_callback_go_through_the_resolvers_ring(timer):
    charged = []
    with timer.region("before"):
        pass
    handle = timer.start("step", on_elapsed=charged.append)
    timer.stop(handle)
    assert len(timer.core.ring) == 1 and timer.core.hot.queued >= 1
    with timer.region("after"):
        pass
    assert timer.flush(5)
    assert charged == [pytest.approx(STEP_MS * 1e-3)]
    assert [histogram(timer, op).count for op in ("before", "step", "after")] == [1, 1, 1]
    assert len(timer.core.pools[0]) == POOL


def test_a_full_ring_drops_and_counts_then_recovers(registry):
    route = CudaShapedRoute()
    timer = make(route, ring_size=4)
    try:
        route.gpu_ms = 0.0  # the GPU finishes nothing for now
        for _ in range(6):
            with timer.region("exact"):
                pass
        assert timer.dropped["ring_full"] == 2 and timer.core.pending() == 4
        route.gpu_ms = float("inf")
        assert timer.flush(5)
        assert histogram(timer, "exact").count == 4 and len(timer.core.pools[0]) == POOL
    finally:
        timer.close(timeout=1.0)


def test_the_thread_picks_each_pairs_device_before_asking_cuda():
    """The recycler's first CUDA call selects the device of its first pair (a call on a thread with
    none current would open a context on device 0), then leaves global capture mode once; a pair of
    another device is asked about with that device current."""
    route = CudaShapedRoute()
    route.device = 1
    timer = make(route)
    try:
        with timer.region("exact"):
            pass
        assert timer.core.hot.recycle_pass(5.0)  # the thread's first pair is on device 1
        route.use_device(0)
        timer.core.add_device(0)
        with timer.region("exact"):
            pass
        assert timer.flush(5)
        cuda = [call for call in route.calls if call[0] != "query" or call[1] is not None]
        assert cuda[:2] == [("set_device", 1), ("capture_mode", 2)]
        queries = [call for call in cuda if call[0] == "query"]
        assert queries and all(event_device == current for _, event_device, current in queries)
        assert {device for _, device, _ in queries} == {0, 1}
        assert [call[0] for call in cuda].count("capture_mode") == 1
        assert histogram(timer, "exact", 0).count == 1 and histogram(timer, "exact", 1).count == 1
    finally:
        timer.close(timeout=1.0)


def test_closing_stops_the_thread_before_the_events_are_destroyed():
    route = CudaShapedRoute()
    timer = make(route)
    route.gpu_ms = 0.0  # one pair stays unfinished: the thread keeps asking about it until stopped
    with timer.region("exact"):
        pass
    assert timer.core.hot.recycle_pass(5.0)
    timer.close(timeout=0.2)
    assert not timer.core.recycling and route.destroyed
    calls = len(route.calls)
    assert not timer.core.hot.recycle_pass(0.05)  # no thread answers any more
    assert len(route.calls) == calls


@pytest.mark.parametrize("shared_pair", ["unread", "read", "collected"])
def test_a_lost_boundary_gives_the_shared_event_back_after_its_pair(timer, shared_pair):
    """A sequence's open event is also the end of its last queued pair. When the next boundary cannot
    be recorded, that event comes back exactly once, whether the recycler has not read the pair yet
    (it gives the event back as it reads it), has read it, or the pair was collected too."""
    route = timer.core.route
    if shared_pair == "unread":
        route.gpu_ms = 0.0
    seq = timer.sequence()
    seq.begin()
    seq.split("first")
    seq.split("second")
    if shared_pair == "read":
        assert timer.core.hot.recycle_pass(5.0) and timer.core.hot.queued == 1
    elif shared_pair == "collected":
        assert timer.flush(5) and timer.core.pending() == 0
    errors = timer.dropped["error"]
    route.record_fails = True
    seq.split("third")
    route.record_fails = False
    seq.end()
    assert timer.dropped["error"] == errors + 1
    route.gpu_ms = float("inf")
    assert timer.flush(5)
    assert histogram(timer, "first").count == 1 and histogram(timer, "second") is None
    free = timer.core.pools[0]
    assert len(free) == POOL and len(set(free)) == POOL


def test_sequences_over_a_full_ring_lose_no_event(registry):
    route = CudaShapedRoute()
    timer = make(route, ring_size=4)
    try:
        route.gpu_ms = 0.0
        seq = timer.sequence()
        for _ in range(5):  # 15 regions: 4 fit in the ring
            with seq:
                for op in ("a", "b", "c"):
                    seq.split(op)
        assert timer.dropped["ring_full"] == 11
        route.gpu_ms = float("inf")
        assert timer.flush(5)
        observed = sum(h.count for op in "abc" if (h := histogram(timer, op)))
        assert observed == 4
        free = timer.core.pools[0]
        assert len(free) == POOL and len(set(free)) == POOL
    finally:
        timer.close(timeout=1.0)
