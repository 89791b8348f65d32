"""The share scheduler as pure code: shares, priorities, who binds, token buckets."""

import pytest

from gpuscope.share.ledger import TenantPolicy
from gpuscope.share.scheduler import (
    LONE_AIM,
    LONE_STEP,
    SliceScheduler,
    TokenBuckets,
    beside_fraction,
    own_time,
    split_overlap,
    waits_throughput,
)
from gpuscope.share.settings import SUGGESTED_STARVED_BELOW


def simulate(s: SliceScheduler, wanting, slice_s: float, rounds: int) -> list[float]:
    """Give slices to whoever pick() names, each using its whole slice; returns GPU seconds per slot."""
    got = [0.0] * len(s.tenants)
    now = 0.0
    for _ in range(rounds):
        slot = s.pick(wanting, now)
        got[slot] += slice_s
        now += slice_s
        s.charge(slot, slice_s, now)
    return got


def test_two_busy_tenants_get_their_shares():
    s = SliceScheduler([TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)])
    got = simulate(s, {0, 1}, 0.01, 1000)
    assert got[0] / sum(got) == pytest.approx(0.7, abs=0.01)


def test_shares_are_relative_among_those_that_want_the_gpu():
    s = SliceScheduler([TenantPolicy("a", 0.2), TenantPolicy("b", 0.2), TenantPolicy("c", 0.6)])
    got = simulate(s, {0, 1}, 0.01, 1000)  # c is idle: a and b split evenly
    assert got[2] == 0
    assert got[0] / sum(got) == pytest.approx(0.5, abs=0.01)


def test_a_higher_priority_tenant_goes_first_within_its_share():
    s = SliceScheduler([TenantPolicy("hog", 0.7, 0), TenantPolicy("online", 0.3, 5)])
    assert s.pick({0, 1}, 0.0) == 1  # nothing used yet: the online tenant first
    s.charge(1, 0.01, 0.01)
    assert s.pick({0, 1}, 0.01) == 0  # over its share: the hog's turn
    assert s.preempts(0, 1, {0, 1}) is False
    s.charge(0, 0.05, 0.06)
    assert s.preempts(0, 1, {0, 1}) is True  # back within its share: it may cut the hog's slice


def test_priority_does_not_buy_more_than_the_share():
    s = SliceScheduler([TenantPolicy("hog", 0.7, 0), TenantPolicy("online", 0.3, 5)])
    got = simulate(s, {0, 1}, 0.01, 1000)
    assert got[1] / sum(got) == pytest.approx(0.3, abs=0.015)


def test_higher_priority_tenants_within_their_share_run_beside_the_holder():
    s = SliceScheduler([TenantPolicy("hog", 0.7, 0), TenantPolicy("online", 0.3, 5),
                        TenantPolicy("batch", 0.2, 0)])
    assert s.beside({0}) == set() and s.beside({1}) == set()  # alone: nothing to run beside
    assert s.beside({0, 1}) == {1}
    assert s.beside({0, 2}) == set()  # equal priorities, never probed: they take turns in slices
    s.charge(0, 0.09, 0.0)
    s.charge(1, 0.01, 0.0)  # a latency-bound tenant: little busy time
    assert s.beside({0, 1}) == {1}
    s.charge(1, 0.1, 0.0)  # now over its share: it takes turns like the others until back within
    assert s.beside({0, 1}) == set()
    # unless its probes show it keeps the GPU busy for less than its share: taking turns it would be
    # charged its holding time (its share) and never get back within it
    assert s.beside({0, 1}, busy={1: 0.2}) == {1}
    # busy beyond its share, up to twice it: still beside, held to its share by a duty cycle
    assert s.beside({0, 1}, busy={1: 0.5}) == {1}
    assert s.beside({0, 1}, busy={1: 0.61}) == set()  # beyond twice its share: it takes turns
    # one already beside stays there a little past the limit, so that probe noise does not move it
    # between the duty and the turns; well past it, it takes turns too
    assert s.beside({0, 1}, busy={1: 0.61}, now_beside={1}) == {1}
    assert s.beside({0, 1}, busy={1: 0.76}, now_beside={1}) == set()
    s2 = SliceScheduler([TenantPolicy("hog", 0.4, 0), TenantPolicy("online", 0.6, 5)])
    s2.charge(1, 1.0, 0.0)
    assert s2.beside({0, 1}, busy={1: 0.55}) == {1}  # within its share of busy time
    assert s2.beside({0, 1}, busy={1: 0.9}) == set()  # GPU-bound beyond its share: turns, not a duty


def test_a_tenant_that_leaves_the_gpu_idle_runs_beside_whatever_its_priority():
    s = SliceScheduler([TenantPolicy("hog", 0.7, 0), TenantPolicy("train", 0.7, 0),
                        TenantPolicy("encoder", 0.3, 0)])
    assert s.beside({0, 2}) == set()  # never probed: equal priorities take turns
    # busy at most its share and at most half the time: beside, the GPU fills its gaps with the hog's
    assert s.beside({0, 2}, busy={0: 1.0, 2: 0.25}) == {2}
    # up to twice its share (held to it by a duty cycle), never more than half the time
    assert s.beside({0, 2}, busy={0: 1.0, 2: 0.45}) == {2}
    assert s.beside({0, 2}, busy={0: 1.0, 2: 0.55}) == set()
    assert s.beside({0, 2}, busy={0: 1.0, 2: 0.55}, now_beside={2}) == {2}  # probe noise: it stays
    assert s.beside({0, 2}, busy={0: 1.0, 2: 0.7}, now_beside={2}) == set()
    # a large share does not let a tenant that keeps the GPU busy most of the time beside: time-sliced
    # with the holder it would get about half of what it needs
    assert s.beside({0, 1}, busy={0: 1.0, 1: 0.6}) == set()
    assert s.beside({0, 1}, busy={0: 1.0, 1: 0.4}) == {1}
    # several that leave the GPU idle all run beside, and nobody takes turns
    assert s.beside({0, 1, 2}, busy={0: 0.2, 1: 0.3, 2: 0.1}) == {0, 1, 2}


def test_a_duty_holds_a_tenant_back_only_while_the_gpu_is_oversubscribed():
    s = SliceScheduler([TenantPolicy("train", 0.7, 0), TenantPolicy("small", 0.3, 0)])
    # over its 30%, but the two together need less than the GPU: nobody is held back
    assert s.duty(1, {0, 1}, 0.45, {0: 0.4, 1: 0.45}) == 1.0
    # together more than the GPU: held to its share
    assert s.duty(1, {0, 1}, 0.45, {0: 0.7, 1: 0.45}) == pytest.approx(0.3 / 0.45)
    # a tenant not yet probed counts as keeping the GPU busy
    assert s.duty(1, {0, 1}, 0.45, {1: 0.45}) == pytest.approx(0.3 / 0.45)


def test_the_lone_holder_gets_the_time_the_tenants_beside_it_leave():
    """The failure it is for (an H100): an encoder of share 0.3 held the GPU all the time beside a
    training loop and a launch-bound MLP, which got 0.15 of its alone rate on a 0.2 share."""
    s = SliceScheduler([TenantPolicy("train", 0.5), TenantPolicy("encoder", 0.3), TenantPolicy("mlp", 0.2),
                        TenantPolicy("online", 0.2, 1)])
    busy = {0: 0.45, 1: 0.85, 2: 0.25, 3: 0.1}
    # the others need 0.7 of the GPU: 0.3 left, its share; busy 85% while it launches
    assert s.lone_holder_duty(1, {0, 2}, busy) == pytest.approx(0.3 / 0.85)
    # they need less: it gets what they leave, more than its share
    assert s.lone_holder_duty(1, {0, 2}, {**busy, 0: 0.2, 2: 0.1}) == pytest.approx(0.7 / 0.85)
    # they need more than the GPU: still its fair share among the three
    assert s.lone_holder_duty(1, {0, 2}, {**busy, 0: 0.5, 2: 0.5}) == pytest.approx(0.3 / 0.85)
    # everyone fits the GPU: nobody is held back
    assert s.lone_holder_duty(1, {2}, {**busy, 1: 0.6}) == 1.0
    # a tenant beside it not yet probed, or itself not probed: not held
    assert s.lone_holder_duty(1, {0, 2}, {1: 0.85, 2: 0.25}) == 1.0
    assert s.lone_holder_duty(1, {0, 2}, {0: 0.45, 2: 0.25}) == 1.0
    # a latency tenant (higher priority) beside it: its own duty and the short queue serve it
    assert s.lone_holder_duty(1, {2, 3}, busy) == 1.0
    assert s.lone_holder_duty(1, set(), busy) == 1.0  # nobody beside: nothing to leave time for
    # its throughput lately, under its duty: the others ran beside it in its part of the time too
    base = 0.3 / 0.85
    # under its share: more time, by at most LONE_STEP at a time
    assert s.lone_holder_duty(1, {0, 2}, busy, throughput=0.25, current=base) == pytest.approx(
        base * LONE_AIM * 0.3 / 0.25)
    assert s.lone_holder_duty(1, {0, 2}, busy, throughput=0.05, current=base) == pytest.approx(
        base * LONE_STEP)
    # well over its aim: less time, but never under what the others leave
    assert s.lone_holder_duty(1, {0, 2}, busy, throughput=0.9, current=0.9) == pytest.approx(
        max(base, 0.9 / LONE_STEP))
    assert s.lone_holder_duty(1, {0, 2}, busy, throughput=0.9, current=base) == pytest.approx(base)
    assert s.lone_holder_duty(1, {0, 2}, busy, throughput=0.1, current=0.9) == 1.0


def test_a_tenant_beside_the_holder_over_its_share_launches_for_its_share_of_the_time():
    s = SliceScheduler([TenantPolicy("hog", 0.7, 0), TenantPolicy("online", 0.3, 5),
                        TenantPolicy("batch", 0.3, 0)])
    assert s.duty(1, {0, 1}, None) == 1.0  # not probed yet
    assert s.duty(1, {0, 1}, 0.25) == 1.0  # fits its 30%
    assert s.duty(1, {0, 1}, 0.4) == pytest.approx(0.75)  # busy 40% for 3/4 of the time: 30%
    assert s.duty(1, {0, 1}, 0.7) == pytest.approx(0.3 / 0.7)  # past twice its share, staying beside
    assert s.duty(1, {0, 1}, 0.9) == 0.4  # never below the least a tenant beside the holder may need
    # its share among the active tenants: with the batch tenant too, 0.3 of 1.3
    assert s.duty(1, {0, 1, 2}, 0.3) == pytest.approx(0.3 / 1.3 / 0.3)


def test_binding_needs_two_active_tenants_and_pick_needs_a_wanting_one():
    s = SliceScheduler([TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    assert not s.binds({0})
    assert not s.binds(set())
    assert s.binds({0, 1})
    assert s.pick(set(), 0.0) is None
    assert s.pick({1}, 0.0) == 1


def test_usage_is_forgotten_over_time():
    s = SliceScheduler([TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)], memory_s=1.0)
    s.charge(0, 10.0, 0.0)
    assert s.pick({0, 1}, 0.0) == 1
    s.charge(1, 0.001, 30.0)  # 30 memory times later a's old use has decayed away
    assert s.used[0] < 1e-9
    with pytest.raises(ValueError):
        SliceScheduler([TenantPolicy("a", 1.0)], memory_s=0)


def test_token_buckets_hold_a_tenant_over_its_share():
    b = TokenBuckets([TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)], burst_s=0.05)
    mask = 0xFFFF
    for _ in range(20):  # b runs at 60% of the GPU for 2 s: its bucket empties
        mask = b.update({0: 0.4, 1: 0.6}, {0, 1}, 0.1)
    assert mask == 0b01
    for _ in range(3):  # held: no utilization, it refills at 0.3 per second
        mask = b.update({0: 0.9, 1: 0.0}, {0, 1}, 0.1)
    assert mask & 0b10
    assert b.update({0: 1.0}, {0}, 0.1) == 0xFFFF  # alone: nothing binds


def test_token_buckets_hold_every_tenant_over_its_share():
    # time-sliced, two busy processes each read ~99% in NVML: both buckets empty, both are held
    b = TokenBuckets([TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)], burst_s=0.05)
    for _ in range(10):
        mask = b.update({0: 0.99, 1: 0.99}, {0, 1}, 0.1)
    assert mask == 0
    assert b.update({0: 0.0, 1: 0.0}, {0, 1}, 0.1) == 0b01  # a refills faster (0.7/s) and runs first


def test_slices_are_longer_for_larger_shares():
    s = SliceScheduler([TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)])
    assert s.quantum(1, {0, 1}, 0.02) == pytest.approx(0.02)
    assert s.quantum(0, {0, 1}, 0.02) == pytest.approx(0.02 * 0.7 / 0.3)
    assert s.quantum(0, {0}, 0.02) == pytest.approx(0.02)


def test_the_holders_unposted_time_counts_when_picking():
    s = SliceScheduler([TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    s.charge(0, 0.010, 0.0)
    s.charge(1, 0.012, 0.0)
    assert s.pick({0, 1}, 0.0) == 0
    assert s.pick({0, 1}, 0.0, pending={0: 0.005}) == 1  # a's running slice puts it past b
    assert s.used[0] == pytest.approx(0.010)  # pending is not charged


def test_nvml_samples_are_held_between_reports():
    from gpuscope.share.nvml_source import SampleHold

    clock = [0.0]
    reports = iter([{7: 0.6}, {}, {}, {8: 0.2}, {}, {}])
    held = SampleHold(lambda: next(reports), hold_s=1.0, clock=lambda: clock[0])
    assert held() == {7: 0.6}
    clock[0] = 0.5
    assert held() == {7: 0.6}  # no new sample: the last one still counts
    clock[0] = 1.2
    assert held() == {}  # stale
    clock[0] = 1.3
    assert held() == {8: 0.2}


def test_held_samples_let_the_bucket_bind():
    """A 60% tenant with a 0.3 share, sampled once per second, is held within a few seconds."""
    from gpuscope.share.nvml_source import SampleHold

    clock = [0.0]

    def fresh():
        return {1: 0.6, 2: 0.4} if clock[0] % 1.0 < 0.05 else {}

    held = SampleHold(fresh, clock=lambda: clock[0])
    b = TokenBuckets([TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)])
    masks = []
    for _ in range(60):
        util = held()
        masks.append(b.update({0: util.get(2, 0.0), 1: util.get(1, 0.0)}, {0, 1}, 0.1))
        clock[0] = round(clock[0] + 0.1, 3)
    assert 0b01 in masks  # b was held at some point


def test_time_posted_while_tenants_overlapped_is_split_as_the_gpu_time_sliced_it():
    # a hog with work all the time and a latency-bound tenant whose queue was non-empty 40% of the
    # time: over that 40% the GPU alternated between them, so each really had 20%
    got = split_overlap({0: 1.0, 1: 0.4}, 1.0)
    assert got[0] == pytest.approx(0.8) and got[1] == pytest.approx(0.2)
    assert split_overlap({0: 0.5, 1: 0.3}, 1.0) == {0: 0.5, 1: 0.3}  # no overlap: as posted
    # three tenants: the excess is shared evenly, nobody loses more than half of what it posted
    got = split_overlap({0: 1.0, 1: 0.1, 2: 0.9}, 1.0)
    assert got[1] == pytest.approx(0.05) and sum(got.values()) == pytest.approx(1.0)
    # never more than the wall time in all, whatever was posted
    assert sum(split_overlap({0: 3.0, 1: 3.0}, 1.0).values()) == pytest.approx(1.0)


def test_a_tenant_beside_the_holder_is_charged_its_kernels_and_the_holder_the_rest():
    # the holder's windows spanned the other tenant's turns: it gets the wall time less those
    got = own_time({0: 1.0, 1: 0.12}, 1.0, exact={1})
    assert got[1] == pytest.approx(0.12) and got[0] == pytest.approx(0.88)
    assert own_time({0: 0.5, 1: 0.1}, 1.0, exact={1}) == {0: 0.5, 1: 0.1}  # no overlap
    assert own_time({0: 1.0, 1: 2.0}, 1.0, exact={1}) == {0: 0.0, 1: 1.0}  # never more than the wall


def test_an_idle_tenant_within_its_share_keeps_its_claim_and_one_over_it_does_not():
    s = SliceScheduler([TenantPolicy("train", 0.7), TenantPolicy("hog", 0.3)])
    s.charge(0, 0.2, 1.0)  # train used little (its host work is not charged), the hog the rest
    s.charge(1, 0.8, 1.0)
    assert s.keeps_claim(0, {1}, 1.0)
    assert not s.keeps_claim(1, {0}, 1.0)  # the hog, idle a moment, is over its share: no claim
    assert not s.keeps_claim(0, set(), 1.0)  # nobody waits: nothing to lend
    s.charge(0, 3.0, 1.0)
    assert not s.keeps_claim(0, {1}, 1.0)  # now over its share: the hog's turns are the hog's


def test_lent_gaps_are_charged_to_the_borrower_and_the_lender_keeps_its_rate():
    """A training-like tenant (3 ms of kernels, then 3 ms on the host) on a 0.7 share beside a hog: each
    gap is lent to the hog and charged to it, the trainer only for its kernels. It keeps its claim at
    every step, so it runs every step at once (its alone rate) and the GPU never idles."""
    s = SliceScheduler([TenantPolicy("train", 0.7), TenantPolicy("hog", 0.3)])
    now, steps, claims = 0.0, 0, 0
    while now < 4.0:
        claims += s.keeps_claim(0, {1}, now)  # it comes back: the turn is its own
        now += 0.003
        s.charge(0, 0.003, now)  # its kernels
        steps += 1
        now += 0.003
        s.charge(1, 0.003, now)  # its host work, lent: the hog's kernels
    assert steps == pytest.approx(4.0 / 0.006, abs=1)
    assert claims == steps  # never over its share: 0.5 of the GPU used against 0.7 promised
    used = s.usage(now)
    assert used[0] / sum(used) == pytest.approx(0.5, abs=0.01)  # charged kernel time, not turn time


def test_a_duty_follows_what_the_tenant_was_charged_not_only_its_probe():
    s = SliceScheduler([TenantPolicy("hog", 0.7, 0), TenantPolicy("online", 0.3, 1)])
    demand = {0: 1.0, 1: 0.45}
    # its probe read it busy 0.45 (an open-loop tenant probed with requests queued): held by that alone
    assert s.duty(1, {0, 1}, 0.45, demand) == pytest.approx(0.3 / 0.45)
    # but its launches were charged 0.15 of the GPU's time at a duty of 1: within its share, not held
    assert s.duty(1, {0, 1}, 0.45, demand, rate=0.15, current=1.0) == 1.0
    # 0.25 at a duty of 2/3 is 0.375 a unit of duty: held to its share by that, not by its probe
    assert s.duty(1, {0, 1}, 0.45, demand, rate=0.25, current=2 / 3) == pytest.approx(0.3 / 0.375)
    # a charged rate over its probe (charges from turns it took before) does not hold it tighter
    assert s.duty(1, {0, 1}, 0.45, demand, rate=0.9, current=1.0) == pytest.approx(0.3 / 0.45)


def test_a_duty_from_charges_settles_for_a_closed_and_an_open_loop():
    """Applied again and again to the rate each duty gives: a closed loop that would use 0.45 of the GPU
    settles at its 0.3 share, an open loop whose requests need 0.15 is let run."""
    s = SliceScheduler([TenantPolicy("hog", 0.7, 0), TenantPolicy("online", 0.3, 1)])
    for wants, settles in ((0.45, 0.3 / 0.45), (0.15, 1.0)):
        duty = 1.0
        for _ in range(20):
            rate = min(wants, duty * 0.45)  # what it is charged at this duty (0.45 flat out)
            duty = s.duty(1, {0, 1}, 0.45, {0: 1.0, 1: 0.45}, rate=rate, current=duty)
        assert duty == pytest.approx(settles, rel=0.01)
        assert min(wants, duty * 0.45) <= 0.3 + 1e-9


def test_a_tenant_doing_well_under_its_share_beside_the_holder_is_starved():
    tenants = [TenantPolicy("train", 0.5), TenantPolicy("encoder", 0.3), TenantPolicy("mlp", 0.2),
               TenantPolicy("online", 0.3, 1)]
    s = SliceScheduler(tenants, starved_below=SUGGESTED_STARVED_BELOW)
    active = {0, 1, 2}
    assert not SliceScheduler(tenants).starved(2, active, 0.01)  # off unless asked for
    # at 0.12 of its alone rate on a fair share of 0.2 (a compiled MLP beside training and an encoder)
    assert s.starved(2, active, 0.12)
    # at 0.16 it is near enough its share, and at or over it not starved at all
    assert not s.starved(2, active, 0.16)
    assert not s.starved(2, active, 0.2)
    assert not s.starved(2, active, None)  # no estimate yet
    # the training loop time-slicing gives 0.695 on a 0.7 share stays beside; at 0.4 it is starved
    assert not s.starved(0, {0, 1}, 0.695)
    assert s.starved(0, {0, 1}, 0.4)
    # a tenant beside by its priority serves what its requests ask (an open loop): never starved
    assert not s.starved(3, {0, 3}, 0.01)


def test_a_loops_throughput_is_read_from_its_waits_for_the_gpu():
    # a step of 0.2 ms on the host and 0.1 ms waiting for its kernels alone (a third of its time);
    # beside a hog each wait grows to 2.3 ms: 2.5 ms a step, 0.12 of its alone rate
    assert waits_throughput(0.1 / 0.3, 2.3 / 2.5) == pytest.approx(0.3 / 2.5)
    # its host work twice as long on a busy CPU, its waits as alone: slower, but not for the GPU
    assert waits_throughput(0.1 / 0.3, 0.1 / 0.5) > 1
    assert waits_throughput(0.97, 0.99) is None  # waiting all the time alone: nothing to compare
    assert waits_throughput(0.0, 0.0) == 1.0  # a loop that never waits reads as unslowed


def test_a_tenant_beside_the_holder_reads_the_lesser_of_its_waits_and_its_launches_where_it_waits_more():
    # a probe that woke late from its syncs read 0.9 waiting alone: the waits say 0.6, the launches 0.06
    assert beside_fraction(0.9, 0.94, 0.06) == pytest.approx(0.06)
    # the waits lower: taken
    assert beside_fraction(0.6, 0.94, 0.5) == pytest.approx(0.06 / 0.4)
    # fewer launches but fewer waits too: it has less to do, not less GPU; the waits are read
    assert beside_fraction(0.6, 0.3, 0.2) == pytest.approx(0.7 / 0.4)
    # waiting all the time alone: the launches alone, where it waits more; nothing otherwise
    assert beside_fraction(0.97, 0.99, 0.1) == pytest.approx(0.1)
    assert beside_fraction(0.97, 0.99, None) is None
    assert beside_fraction(0.6, 0.9, None) == pytest.approx(0.25)


def test_a_starved_tenant_takes_turns_whatever_its_probes_say_unless_its_priority_lets_it_beside():
    s = SliceScheduler([TenantPolicy("hog", 0.8), TenantPolicy("mlp", 0.2), TenantPolicy("online", 0.2, 1)])
    busy = {0: 1.0, 1: 0.3, 2: 0.3}
    assert s.beside({0, 1}, busy) == {1}  # busy under twice its share: beside, by its probes
    assert s.beside({0, 1}, busy, now_beside={1}, to_turns={1}) == set()
    # the priority rule is not the probes': a latency tenant within its share stays beside
    assert s.beside({0, 2}, busy, to_turns={2}) == {2}
