"""The timer's data model, ``BucketHistogram`` and ``OpState``: every test runs on the C types
(``_hotpath``) and on their Python twins (``histogram.py``), and one runs the same inputs through
both and compares everything they expose."""

from __future__ import annotations

import gc
import math
import random
import weakref

import pytest

from gpuscope.contract.catalogue import REGION_SECONDS_BUCKETS
from gpuscope.timing import histogram
from tests.timing.conftest import require_native


@pytest.fixture
def model(hot_path):
    """The module holding the data model of each hot path: the C extension, or histogram.py."""
    if hot_path:
        from gpuscope.timing import _hotpath

        return _hotpath
    return histogram


def rows(h) -> list[tuple[str, int]]:
    return [(le, count) for le, count, _ in h.cumulative()]


def test_upper_bounds_are_inclusive_and_cumulative_counts_end_at_inf(model):
    h = model.BucketHistogram((0.1, 1.0))
    for v in (0.1, math.nextafter(0.1, 1.0), 0.5, 1.0, math.nextafter(1.0, 2.0), 2.0):
        assert h.observe(v) is True
    assert h.counts == [1, 3, 2]
    assert rows(h) == [("0.1", 1), ("1.0", 4), ("+Inf", 6)]
    assert h.count == 6
    assert h.sum == 0.1 + math.nextafter(0.1, 1.0) + 0.5 + 1.0 + math.nextafter(1.0, 2.0) + 2.0


def test_edge_values(model):
    """Zero and the smallest positive value go to the first bucket; a negative duration (a baseline
    larger than the measurement) counts as 0; infinities and huge values land in +Inf; NaN is
    refused and changes nothing."""
    h = model.BucketHistogram((0.1, 1.0))
    for v in (0.0, -0.0, 5e-324, -3.0, -math.inf):
        assert h.observe(v) is True
    assert h.counts == [5, 0, 0] and h.sum == 5e-324
    assert h.observe(math.nan) is False
    assert h.observe(math.nan, "trace") is False
    assert h.counts == [5, 0, 0] and h.count == 5 and h.exemplars == [None, None, None]
    assert h.observe(1e308) is True
    assert h.counts == [5, 0, 1] and h.sum == 1e308
    assert h.observe(math.inf) is True
    assert h.counts == [5, 0, 2] and h.sum == math.inf and h.count == 7


def test_exemplars_keep_the_last_trace_of_each_bucket(model):
    h = model.BucketHistogram(REGION_SECONDS_BUCKETS)
    h.observe(3e-6, "trace-a")
    h.observe(3e-6)  # no trace: the bucket keeps its exemplar
    h.observe(4e-6, "")  # an empty trace id is none
    h.observe(1.5, "trace-b")
    h.observe(1.2, "trace-c")
    h.observe(-1.0, "trace-d")  # stored as the value counted
    found = {le: exemplar[:2] for le, _, exemplar in h.cumulative() if exemplar}
    assert found == {"5e-06": ("trace-a", 3e-6), "2.5": ("trace-c", 1.2), "1e-06": ("trace-d", 0.0)}
    assert all(exemplar is None or exemplar[2] > 1e9 for exemplar in h.exemplars)  # unix time


def test_le_labels_are_the_bounds_as_prometheus_writes_them(model):
    h = model.BucketHistogram(REGION_SECONDS_BUCKETS)
    assert [le for le, _, _ in h.cumulative()] == [repr(float(b)) for b in REGION_SECONDS_BUCKETS] + ["+Inf"]
    assert h.bounds == tuple(float(b) for b in REGION_SECONDS_BUCKETS)


def test_quantile_reports_the_upper_bound_of_its_bucket(model):
    h = model.BucketHistogram((1.0, 2.0, 3.0))
    assert math.isnan(h.quantile(0.5))
    for v in (0.5, 1.5, 1.5, 2.5):
        h.observe(v)
    assert h.quantile(0.5) == 2.0
    assert h.quantile(0.99) == 3.0
    h.observe(4.0)
    assert h.quantile(1.0) == math.inf


def test_readers_get_copies(model):
    h = model.BucketHistogram((1.0,))
    h.observe(0.5, "t")
    counts, exemplars = h.counts, h.exemplars
    counts[0] = 99
    exemplars[0] = None
    assert h.counts == [1, 0] and h.exemplars[0][0] == "t"


@pytest.mark.parametrize("bounds", [(1.0, 1.0), (2.0, 1.0), (math.nan,), (0.1, math.nan)])
def test_bounds_must_ascend(model, bounds):
    with pytest.raises(ValueError, match="ascending"):
        model.BucketHistogram(bounds)


def test_a_new_op_state_times_its_first_region(model):
    op = model.OpState("attn", 16, False, REGION_SECONDS_BUCKETS)
    assert (op.name, op.period, op.fixed, op.countdown, op.entered, op.always, op.owner) == (
        "attn", 16, False, 0, 0, 0, None)
    assert op.hists == {} and op.bounds == tuple(REGION_SECONDS_BUCKETS)
    op.entered += 3
    op.period, op.fixed, op.owner = 2, True, "instrumentation"
    assert (op.entered, op.period, op.fixed, op.owner) == (3, 2, True, "instrumentation")


def test_an_op_observes_into_one_histogram_per_device(model):
    op = model.OpState("attn", 1, False, (1e-3, 1e-2))
    assert op.observe(0, 2e-3, "t") is True
    assert op.observe(1, 5e-4) is True
    assert op.observe(0, 5e-2) is True
    assert op.observe(1, math.nan) is False
    assert sorted(op.hists) == [0, 1]
    assert op.histogram(0) is op.hists[0] and op.histogram(0).counts == [0, 1, 1]
    assert op.hists[1].counts == [1, 0, 0] and op.hists[1].bounds == (1e-3, 1e-2)
    assert op.histogram(2).count == 0 and sorted(op.hists) == [0, 1, 2]


def test_sampling_transitions_of_an_op(make_timer):
    """The hot path counts every region, times one in ``period``, and the controls change the
    period: the same steps leave the same state on both implementations."""
    timer = make_timer(resolve_interval=3600)  # budget mode, with no controller waking meanwhile
    core = timer.core
    op = core.op_state("op")
    assert type(op) is core.op_type and (op.period, op.fixed) == (16, False)
    core.set_period(3)
    seen = []
    for _ in range(7):
        token = core.begin(op)
        if token is not None:
            core.end(op, token, None)
        seen.append((token is not None, op.countdown, op.entered))
    assert seen == [(True, 2, 1), (False, 1, 2), (False, 0, 3), (True, 2, 4), (False, 1, 5),
                    (False, 0, 6), (True, 2, 7)]
    timer.set_sample_rate("op", 0.5)
    other = core.op_state("other")
    core.set_period(8)  # what the budget controller does: a fixed op keeps its own rate
    assert (op.period, op.fixed, other.period, other.fixed) == (2, True, 8, False)
    assert timer.flush(5) and op.hists[core.current_device()].count == 3


def test_a_shorter_period_shortens_the_wait_left_from_the_longer_one(make_timer):
    """The budget lowering the period (or a user setting every pass timed) takes effect within the
    new period, not after the countdown the old period left (the next timed region came that many
    regions late)."""
    timer = make_timer(resolve_interval=3600)
    core = timer.core
    op = core.op_state("op")
    core.set_period(200)
    token = core.begin(op)  # timed: the next 199 wait
    core.end(op, token, None)
    assert op.countdown == 199
    core.set_period(2)
    assert op.countdown <= 1
    timed = [core.begin(op) for _ in range(3)]
    assert sum(t is not None for t in timed[:2]) == 1  # within the new period
    for t in timed:
        if t is not None:
            core.end(op, t, None)
    core.set_period(1)
    assert op.countdown == 0
    token = core.begin(op)
    assert token is not None
    core.end(op, token, None)
    assert timer.flush(5)


def test_an_op_owned_in_a_cycle_is_collected(model):
    class Owner:
        pass

    owner = Owner()
    owner.op = model.OpState("attn", 1, False, (1.0,))
    owner.op.owner = owner
    owner.op.observe(0, 0.5, owner)  # the exemplar refers back too
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None


def agreement_inputs() -> list[tuple[float, str | None]]:
    """Every bound exactly and one step either side, edge values, and random durations over the
    buckets' range; some with a trace id."""
    rng = random.Random(7)
    values = [0.0, -0.0, -1e-9, -5.0, -math.inf, math.inf, math.nan, 1e308, 5e-324, 1e-12, 10.0, 11.0]
    for bound in REGION_SECONDS_BUCKETS:
        values += [bound, math.nextafter(bound, 0.0), math.nextafter(bound, math.inf)]
    values += [10 ** rng.uniform(-7, 1.5) for _ in range(3000)]
    rng.shuffle(values)
    return [(v, f"trace-{i}" if i % 4 == 0 else "" if i % 4 == 2 else None) for i, v in enumerate(values)]


def test_c_and_python_agree_on_the_same_inputs():
    require_native()
    from gpuscope.timing import _hotpath

    def run(module) -> dict:
        op = module.OpState("op", 1, False, REGION_SECONDS_BUCKETS)
        # Huge values on a device of their own: in a sum with the others they would hide any difference.
        taken = [op.observe(int(not abs(value) < 1e3), value, trace) for value, trace in agreement_inputs()]
        out = {"taken": taken}
        for device, h in op.hists.items():
            out[device] = (h.count, h.counts, h.sum.hex(), h.bounds,
                           [(le, n, e and e[:2]) for le, n, e in h.cumulative()],
                           [h.quantile(q) for q in (0.0, 0.01, 0.5, 0.9, 0.99, 1.0)])
        return out

    c, python = run(_hotpath), run(histogram)
    assert c == python
    assert python["taken"].count(False) == 1  # the one NaN
    assert sum(python[device][0] for device in (0, 1)) == len(python["taken"]) - 1
