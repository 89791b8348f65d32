"""The budget controller's decision, from chosen windows: no dependence on how fast this machine is."""

import pytest

from gpuscope.timing.budget import MIN_SAMPLING_RATIO, PassWindow, Window, decide

US = 1e-6


def window(**overrides) -> Window:
    """One second of a program entering 500 direct regions, all sampled, each cheap."""
    values = dict(wall_s=1.0, direct_entered=500, always=0, resolved=500, resolve_busy_s=1e-3,
                  resolver_fixed_s=0.5e-3, hot_s=5 * US, skip_s=0.2 * US)
    values.update(overrides)
    return Window(**values)


def settle(w: Window, period: int, budget: float = 0.01, rounds: int = 10) -> list[int]:
    periods = []
    for _ in range(rounds):
        period, _ = decide(w, budget, period, fixed_rate=False)
        periods.append(period)
    return periods


def test_cheap_and_rare_regions_are_all_timed_within_a_few_steps():
    # 500 × 5 µs + 1.5 ms of resolver = 0.4% of a 1% budget: everything fits. Sampling is given
    # back at most 1.5× per decision (taken at up to 4×)
    assert settle(window(), period=16)[:6] == [10, 6, 4, 2, 1, 1]


def test_expensive_regions_are_thinned_to_the_budget():
    # 10,000 regions of 100 µs a second would cost 100%. Of the 1% budget, aimed at 85% of it
    # (8.5 ms), the resolver's fixed 0.5 ms and 10,000 unsampled regions × 0.2 µs leave 6 ms for
    # sampled regions at 101.6 µs each (record + resolution): one in 169.
    w = window(direct_entered=10_000, resolved=10_000 / 16, hot_s=100 * US)
    periods = settle(w, period=16)
    assert periods[0] == 64  # at most 4× per decision
    assert periods[-1] == 169


def test_always_timed_regions_spend_the_budget_first():
    # 1,000 steps timed every time at 20 µs = 2% of the second: nothing is left for sampling.
    w = window(direct_entered=2_000, always=1_000, resolved=1_000, hot_s=20 * US)
    periods = settle(w, period=16, rounds=8)
    assert periods[-1] == round(1 / MIN_SAMPLING_RATIO)
    _, overhead = decide(w, 0.01, periods[-1], fixed_rate=False)
    assert overhead > 0.01  # the excess is shown, not hidden


def test_sampled_passes_count_with_their_measured_cost():
    # instrument(): 100 passes a second, each sampled pass costing 1 ms of extra CPU (24 regions).
    passes = (PassWindow(passes=100, sampled=100, per_pass_s=1e-3, samples_per_pass=24),)
    w = window(direct_entered=0, resolved=2_400, resolve_busy_s=2.4e-3, passes=passes)
    period, overhead = decide(w, 0.01, 1, fixed_rate=False)
    assert overhead == pytest.approx((0.1 + 2.4e-3 + 0.5e-3) / 1.0)
    assert period == 4  # 10% wants period ~13 (aimed at 0.85%), reached at most 4× per decision
    assert settle(w, period=1)[-1] == pytest.approx(13, abs=1)


def test_a_fixed_rate_or_an_idle_window_keeps_the_period():
    assert decide(window(hot_s=1e-3), 0.01, 8, fixed_rate=True)[0] == 8
    assert decide(window(wall_s=0.0), 0.01, 8, fixed_rate=False) == (8, 0.0)


def test_a_noisy_cost_estimate_moves_sampling_up_slowly_and_down_fast():
    # a sampled pass's cost read in the program jumps between windows: a window that reads it cheap
    # lowers the period by at most 1.5x, one that reads it dear raises it by up to 4x
    def passes(per_pass_s: float) -> Window:
        return window(direct_entered=0, resolved=0, resolve_busy_s=0.0, passes=(
            PassWindow(passes=1000, sampled=50, per_pass_s=per_pass_s, samples_per_pass=6),))
    assert decide(passes(14 * US), 0.01, 20, fixed_rate=False)[0] == 13  # wants about 2
    assert decide(passes(250 * US), 0.01, 20, fixed_rate=False)[0] == 31  # wants about 31
    assert decide(passes(2_500 * US), 0.01, 20, fixed_rate=False)[0] == 80  # wants 313: 4x at most
