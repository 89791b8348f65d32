"""Length specs: parsing, one-line errors, bounds and seeded reproducibility."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuscope.loadtest.distributions import parse_distribution


@pytest.mark.parametrize("spec", [
    "fixed:n=128",
    "uniform:min=16,max=256",
    "normal:mean=128,sd=32,min=8,max=512",
    "lognormal:median=96,sigma=0.6,min=8,max=1024",
    "choice:values=32/128/512,weights=5/3/1",
])
def test_draws_stay_inside_the_bounds(spec):
    dist = parse_distribution(spec)
    rng = random.Random(7)
    draws = [dist.draw(rng) for _ in range(2000)]
    assert min(draws) >= dist.low and max(draws) <= dist.high
    assert all(isinstance(d, int) for d in draws)


def test_same_seed_gives_the_same_sequence_and_another_seed_does_not():
    dist = parse_distribution("lognormal:median=64,sigma=0.8,min=1,max=4096")

    def sequence(seed: str) -> list[int]:
        rng = random.Random(seed)
        return [dist.draw(rng) for _ in range(50)]

    assert sequence("s-1") == sequence("s-1")
    assert sequence("s-1") != sequence("s-2")


def test_lognormal_median_is_where_it_is_asked_to_be():
    dist = parse_distribution("lognormal:median=100,sigma=0.5,min=1,max=100000")
    rng = random.Random(1)
    draws = sorted(dist.draw(rng) for _ in range(4001))
    assert 93 <= draws[2000] <= 107


def test_choice_honours_weights():
    dist = parse_distribution("choice:values=10/20,weights=3/1")
    rng = random.Random(3)
    draws = [dist.draw(rng) for _ in range(4000)]
    assert 0.70 < draws.count(10) / len(draws) < 0.80


@pytest.mark.parametrize(("spec", "needle"), [
    ("gauss:mean=1", "unknown distribution 'gauss'"),
    ("uniform:min=5", "uniform needs max"),
    ("uniform:min=9,max=3", "1 <= min <= max"),
    ("normal:mean=1,sd=0", "spread must be positive"),
    ("fixed:n=abc", "must be numbers"),
    ("fixed:n=3,size=4", "bad parameter 'size=4'"),
    ("choice:values=1/2,weights=1", "one non-negative weight per value"),
    ("choice:values=a/b", "values are integers"),
])
def test_bad_specs_say_what_is_wrong_in_one_line(spec, needle):
    with pytest.raises(ValueError) as info:
        parse_distribution(spec)
    message = str(info.value)
    assert needle in message and "\n" not in message


@given(low=st.integers(1, 500), span=st.integers(0, 500), seed=st.integers(0, 2**32))
def test_uniform_covers_exactly_its_range(low, span, seed):
    dist = parse_distribution(f"uniform:min={low},max={low + span}")
    rng = random.Random(seed)
    assert all(low <= dist.draw(rng) <= low + span for _ in range(20))
