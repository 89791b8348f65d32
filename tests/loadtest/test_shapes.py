"""Stage tables: users and spawn rates at each moment, scaled by --users and --run-time."""

from __future__ import annotations

import pytest

from gpuscope.loadtest.shapes import DEFAULT_RUN_TIME_S, SHAPES, stage_at


def test_steady_holds_the_users_and_rate_then_ends():
    assert stage_at("steady", 0, 60, 10, 2.5) == (10, 2.5)
    assert stage_at("steady", 59.9, 60, 10, 2.5) == (10, 2.5)
    assert stage_at("steady", 60, 60, 10, 2.5) is None


def test_steady_without_run_time_runs_until_stopped():
    assert stage_at("steady", 10**6, None, 4, 1.0) == (4, 1.0)


def test_ramp_reaches_the_peak_evenly_over_80_percent_then_holds():
    users, rate = stage_at("ramp", 1, 100, 40, 99.0)
    assert users == 40 and rate == pytest.approx(40 / 80)  # 40 users over 80 s, not the given 99/s
    assert stage_at("ramp", 90, 100, 40, 5.0) == (40, 5.0)
    assert stage_at("ramp", 100, 100, 40, 5.0) is None


def test_step_adds_a_quarter_each_quarter_at_once():
    got = [stage_at("step", t, 100, 20, 1.0) for t in (0, 30, 60, 90)]
    assert got == [(5, 5.0), (10, 10.0), (15, 15.0), (20, 20.0)]


def test_spike_jumps_to_the_peak_within_a_second_and_back():
    assert stage_at("spike", 10, 100, 20, 0.5) == (6, 6.0)
    assert stage_at("spike", 50, 100, 20, 0.5) == (20, 20.0)
    assert stage_at("spike", 70, 100, 20, 0.5) == (6, 6.0)


def test_shapes_other_than_steady_use_a_default_length_without_run_time():
    assert stage_at("spike", DEFAULT_RUN_TIME_S - 1, None, 10, 1) is not None
    assert stage_at("spike", DEFAULT_RUN_TIME_S, None, 10, 1) is None


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_table_ends_at_the_run_time_and_never_drops_to_zero_users(name):
    table = SHAPES[name]
    assert table[-1].until == 1.0
    assert [s.until for s in table] == sorted(s.until for s in table)
    for t in range(0, 100):
        users, rate = stage_at(name, t, 100, 1, 1.0)
        assert users >= 1 and rate > 0
