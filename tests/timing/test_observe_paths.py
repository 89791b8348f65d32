"""Every path a finished pair takes into the histograms: the Python hot path and loop, the C hot path
with the resolver's Python loop, with its C loop (``_hotpath.Resolve``), and with the recycler thread.
The same scripted regions (CUDA-shaped callbacks, ``cuda_shaped.py``) must give the same
histograms on each, count the same failures, and give every event back."""

from __future__ import annotations

import pytest

from gpuscope.timing import Timer, trace
from tests.timing.conftest import prepared, require_native, time_regions
from tests.timing.cuda_shaped import STEP_MS, CudaShapedRoute

POOL = 64
BASELINE_S = 0.0001
#: path -> (C hot path, recycler thread, the resolver's C loop)
PATHS = {
    "python": (False, False, False),
    "c-hot-path-python-loop": (True, False, False),
    "c-loop": (True, False, True),
    "recycler": (True, True, False),
}


@pytest.fixture(params=list(PATHS))
def timer(request):
    native, recycler, c_loop = PATHS[request.param]
    if native:
        require_native()
    # A resolver that never wakes by itself: flush() resolves when the test chooses.
    made = prepared(Timer(None, route=CudaShapedRoute(), sample_rate=1.0, native=native, recycler=recycler,
                          resolve_interval=3600, pool_size=POOL))
    if not c_loop:
        made.resolver.fast = None
    assert made.core.recycling is recycler and (made.resolver.fast is not None) is c_loop
    made.resolver.baseline_s[0] = BASELINE_S
    yield made
    made.close(timeout=1.0)


def test_every_path_fills_the_same_histograms(timer):
    """Every region lasts one step of the scripted clock; less the baseline, that is the sample. The
    trace id is the exemplar of its bucket, and every event is back in its pool."""
    with trace("abc123"):
        time_regions(timer)
    assert timer.flush(5)
    seconds = STEP_MS * 1e-3 - BASELINE_S
    bucket = next(i for i, bound in enumerate(timer.op_state("exact").bounds) if seconds <= bound)
    for op, n in (("exact", 3), ("first", 2), ("second", 2)):
        h = timer.op_state(op).hists[0]
        assert h.count == n and h.sum == pytest.approx(n * seconds, rel=1e-6)
        assert h.counts[bucket] == n
        assert h.exemplars[bucket][:2] == ("abc123", pytest.approx(seconds, rel=1e-6))
    assert timer.core.pending() == 0 and len(timer.core.pools[0]) == POOL, "an event was not given back"


def test_failed_elapsed_reads_are_counted_and_release_their_events(timer):
    route = timer.route
    errors = timer.dropped["error"]
    route.elapsed_fails = True
    time_regions(timer, exact=3, passes=1)
    assert timer.flush(5)
    assert timer.dropped["error"] - errors == 5  # three exact regions, two in the pass
    if timer.core.recycling or timer.resolver.fast is not None:  # C asked CUDA itself
        assert route.cleared >= 5  # each failure cleared from CUDA's last-error slot
    assert all(op.hists.get(0) is None or op.hists[0].count == 0 for op in timer.core.ops())
    assert len(timer.core.pools[0]) == POOL


def test_a_nan_elapsed_time_is_refused_and_counted(timer):
    timer.route.elapsed_nan = True
    errors = timer.dropped["error"]
    time_regions(timer, exact=2, passes=1)
    assert timer.flush(5)
    assert timer.dropped["error"] - errors == 4
    assert all(h.count == 0 and h.sum == 0.0 for op in timer.core.ops() for h in op.hists.values())
    assert len(timer.core.pools[0]) == POOL
