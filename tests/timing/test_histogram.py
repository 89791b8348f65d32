from gpuscope.contract.catalogue import REGION_SECONDS_BUCKETS
from gpuscope.timing.histogram import BucketHistogram


def test_upper_bounds_are_inclusive_and_cumulative_counts_end_at_inf():
    h = BucketHistogram((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 2.0):
        h.observe(v)
    assert h.cumulative()[0][:2] == ("0.1", 1)
    assert h.cumulative()[1][:2] == ("1.0", 3)
    assert h.cumulative()[2][:2] == ("+Inf", 4)
    assert h.count == 4 and abs(h.sum - 3.6) < 1e-12


def test_exemplar_kept_on_the_bucket_of_its_value():
    h = BucketHistogram(REGION_SECONDS_BUCKETS)
    h.observe(3e-6, "trace-a")
    h.observe(3e-6)
    rows = {le: ex for le, _, ex in h.cumulative()}
    assert rows["5e-06"][0] == "trace-a" and rows["5e-06"][1] == 3e-6
    assert rows["2.5e-06"] is None


def test_quantile_reports_bucket_upper_bound():
    h = BucketHistogram((1.0, 2.0, 3.0))
    for v in (0.5, 1.5, 1.5, 2.5):
        h.observe(v)
    assert h.quantile(0.5) == 2.0
    assert h.quantile(0.99) == 3.0
