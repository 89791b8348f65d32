"""The resolver's C loop (``_hotpath.Resolve``): the same observations as the Python loop, through
CUDA-shaped C functions (here ctypes callbacks standing in for cudaEventQuery,
cudaEventElapsedTime and cudaGetLastError), with unfinished pairs left in order and failures counted."""

import ctypes

import pytest

from gpuscope.timing import Timer, hot, trace
from gpuscope.timing.routes import HostRoute
from tests.timing.conftest import prepared

RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
QUERY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
ELAPSED_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)
LAST_ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_int)
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_INVALID_RESOURCE_HANDLE = 400
STEP_MS = 0.25  # every record advances the scripted GPU clock by 250 µs

pytestmark = pytest.mark.skipif(not hot.native_available(), reason="the C extension is not built")


class CudaShapedRoute(HostRoute):
    """Integer events and the four CUDA functions the C code calls by address. The clock advances
    ``STEP_MS`` per record, so every region of back-to-back records lasts exactly that long;
    events in ``not_ready`` are not finished yet."""

    def __init__(self) -> None:
        self.stamps: dict[int, float] = {}
        self.clock_ms = 0.0
        self.not_ready: set[int] = set()
        self.elapsed_fails = False
        self.queries = self.elapsed_calls = self.cleared = 0
        self._next = 1000

        def record(event, stream):
            self.clock_ms += STEP_MS
            self.stamps[event] = self.clock_ms
            return 0

        def query(event):
            self.queries += 1
            return CUDA_ERROR_NOT_READY if event in self.not_ready else 0

        def elapsed(ms, start, end):
            self.elapsed_calls += 1
            if self.elapsed_fails:
                return CUDA_ERROR_INVALID_RESOURCE_HANDLE
            ms[0] = self.stamps[end] - self.stamps[start]
            return 0

        def clear():
            self.cleared += 1
            return 0

        # Kept alive as long as the route; the C code calls them without the GIL, as it calls CUDA.
        self._fns = (RECORD_FN(record), QUERY_FN(query), ELAPSED_FN(elapsed), LAST_ERROR_FN(clear))
        self.record_address, self.query_address, self.elapsed_address, self.clear_error_address = (
            ctypes.cast(fn, ctypes.c_void_p).value for fn in self._fns)

    def create(self) -> int:
        self._next += 1
        return self._next

    def record(self, event: int, stream: int) -> int:
        return self._fns[0](event, stream)

    def query(self, event: int) -> bool:
        return self._fns[1](event) == 0

    def elapsed_s(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        if self._fns[2](ctypes.byref(ms), start, end):
            raise RuntimeError("cudaEventElapsedTime failed")
        return ms.value * 1e-3


@pytest.fixture
def timer(registry):
    route = CudaShapedRoute()
    # A resolver that never wakes by itself: each test drains when it chooses.
    made = prepared(Timer(registry, route=route, sample_rate=1.0, native=True, resolve_interval=3600,
                          pool_size=64))
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
        timer = prepared(Timer(None, route=route, sample_rate=1.0, native=True, resolve_interval=3600,
                               pool_size=64))
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
    assert hot.resolve_loop(HostRoute(), dropped={}, pending_type=tuple, op_type=object) is None


def test_one_query_answers_for_a_stream_whose_last_pair_finished(timer):
    """Events of one stream finish in order, so a finished last pair vouches for the pairs before it:
    one cudaEventQuery per drain here, and one cudaEventElapsedTime per pair."""
    route = timer.route
    time_regions(timer, exact=6, passes=0)
    queries, elapsed = route.queries, route.elapsed_calls
    assert timer.resolver.drain() == 6
    assert (route.queries - queries, route.elapsed_calls - elapsed) == (1, 6)
