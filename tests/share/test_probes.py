"""The prober's schedule as pure code: every tenant in turn, and fewer probes of a tenant whose
probes agree with its estimate (each probe pauses the others)."""

from __future__ import annotations

import itertools

import pytest

from gpuscope.share.probes import Prober
from gpuscope.share.processes import waited_ns
from gpuscope.share.settings import PROBE_LEAD_S, PROBE_READ_LAG_S, PROBE_S


class Mask:
    def __init__(self) -> None:
        self.mask = 0

    def set_busy_mask(self, mask: int) -> None:
        self.mask = mask


class Busy:
    """Each slot's counters: in a probe's lead a slot waits for the GPU ``waiting[slot]`` of its time and
    launches at ``ratio[slot] / LAUNCH_S`` a second; timing each launch, it keeps the GPU busy
    ``ratio[slot] * timed_rate`` of the time, in launches of ``LAUNCH_S`` each (its launches slowed by
    ``timed_rate``, as its events and their queries slow a launch-bound loop)."""

    LAUNCH_S = 1e-4

    def __init__(self, ratio: dict[int, float], waiting: dict[int, float] | None = None,
                 timed_rate: float = 1.0) -> None:
        self.ratio, self.ns, self.timed_rate = ratio, dict.fromkeys(ratio, 0), timed_rate
        self.waiting, self.wait_ns = waiting or {}, dict.fromkeys(ratio, 0)
        self.launch_count = dict.fromkeys(ratio, 0)

    def busy(self, slot: int) -> tuple[int, int]:
        return self.ns[slot], round(self.ns[slot] / 1e9 / self.LAUNCH_S)

    def sync_wait_ns(self, slot: int, now: float) -> int:
        return self.wait_ns[slot]

    def launches(self, slot: int) -> int:
        return self.launch_count[slot]

    def post(self, slot: int, timed: bool) -> None:
        """What the slot's processes post over one phase of its probe."""
        if timed:
            busy_ns = int(self.ratio[slot] * self.timed_rate * PROBE_S * 1e9)
            self.ns[slot] += busy_ns
            self.launch_count[slot] += round(busy_ns / 1e9 / self.LAUNCH_S)
        else:
            self.launch_count[slot] += round(self.ratio[slot] * PROBE_LEAD_S / self.LAUNCH_S)
            self.wait_ns[slot] += int(self.waiting.get(slot, 0.0) * PROBE_LEAD_S * 1e9)


def run(prober: Prober, busy: Busy, candidates: set[int], seconds: float, start: float = 0.0,
        until=lambda: False) -> tuple[list[tuple[float, int]], float]:
    """Drive the prober as the controller's loop does for ``seconds`` from ``start`` (or until
    ``until()``); the probes it started, and when it stopped."""
    probes, now, posted = [], start, None
    while now < start + seconds and not until():
        left = prober.advance(now)
        if left is None and prober.probe is None:
            slot = prober.due(now, candidates)
            if slot is not None:
                assert prober.start(slot, now) == PROBE_LEAD_S
                probes.append((now, slot))
        probe = prober.probe
        if probe is not None and probe.read_at == 0.0 and posted != (probe.slot, probe.started, probe.timed):
            busy.post(probe.slot, probe.timed)  # what the phase just begun will post
            posted = (probe.slot, probe.started, probe.timed)
        now += 0.001
    return probes, now


def test_every_tenant_is_probed_in_turn_without_back_off():
    busy = Busy({0: 0.9, 1: 0.2, 2: 0.5})
    prober = Prober(Mask(), busy, every_s=1.0, backoff=1)
    probes, _ = run(prober, busy, {0, 1, 2}, 30.0)
    slots = [s for _, s in probes]
    assert slots[:3] == [0, 1, 2] and all(slots.count(s) >= 9 for s in (0, 1, 2))
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(probes)]
    assert all(g >= 1.0 for g in gaps[3:])  # one probe a second at most
    assert prober.busy_ratio[1] == pytest.approx(0.2, rel=0.1)  # ends up to a loop step late
    assert prober.launch_s[1] == pytest.approx(Busy.LAUNCH_S, rel=0.01)  # what a beside launch is charged


def test_a_probe_reads_the_part_of_its_time_the_tenant_waits_for_the_gpu():
    busy = Busy({0: 0.9, 1: 0.3}, waiting={0: 0.95, 1: 0.35})
    prober = Prober(Mask(), busy, every_s=1.0, backoff=1)
    run(prober, busy, {0, 1}, 10.0)
    # what its waits beside the holder are compared with (scheduler.beside_fraction); waits after
    # the probe ended, the others running again, are not its own
    assert prober.wait_ratio[1] == pytest.approx(0.35, rel=0.1)
    assert prober.wait_ratio[0] == pytest.approx(0.95, rel=0.1)
    # and its launches a second alone (what its launches beside the holder are compared with): busy
    # 0.3 of the probe in launches of LAUNCH_S
    assert prober.launch_rate[1] == pytest.approx(0.3 / Busy.LAUNCH_S, rel=0.1)


def test_a_probe_reads_launches_and_waits_in_its_lead_not_while_it_times_each_launch():
    # a launch-bound loop that timing each launch slows to half its rate: beside the holder it launches
    # untimed, so the launches a second it is compared with are its untimed ones
    busy = Busy({0: 0.9, 1: 0.3}, waiting={0: 0.95, 1: 0.35}, timed_rate=0.5)
    prober = Prober(Mask(), busy, every_s=1.0, backoff=1)
    run(prober, busy, {0, 1}, 10.0)
    assert prober.launch_rate[1] == pytest.approx(0.3 / Busy.LAUNCH_S, rel=0.1)
    assert prober.wait_ratio[1] == pytest.approx(0.35, rel=0.1)
    # its busy fraction and kernel time a launch come from the timed part, as before
    assert prober.busy_ratio[1] == pytest.approx(0.15, rel=0.1)
    assert prober.launch_s[1] == pytest.approx(Busy.LAUNCH_S, rel=0.01)


def test_a_tenant_whose_probes_agree_is_probed_less_often_down_to_the_back_off():
    busy = Busy({0: 0.95, 1: 0.1, 2: 0.5})
    fixed, backed = Prober(Mask(), busy, every_s=1.0, backoff=1), Prober(Mask(), busy, every_s=1.0, backoff=8)
    for prober in (fixed, backed):
        busy.ns = dict.fromkeys(busy.ratio, 0)
        prober.probes, _ = run(prober, busy, {0, 1, 2}, 200.0)
    assert len(fixed.probes) >= 190
    # steady tenants: 1, 2, 4 rounds apart, then 8 (a round is 3 s with three tenants)
    assert len(backed.probes) < len(fixed.probes) / 4
    times = [t for t, s in backed.probes if s == 0]
    assert 23.0 <= times[-1] - times[-2] <= 26.0  # 8 rounds of 3 s
    assert backed.spacing == {0: 8, 1: 8, 2: 8}


def test_a_probe_that_moves_the_estimate_brings_the_tenant_back_to_every_round():
    busy = Busy({0: 0.95, 1: 0.1})
    prober = Prober(Mask(), busy, every_s=1.0, backoff=8)
    run(prober, busy, {0, 1}, 60.0)
    assert prober.spacing[1] == 8
    busy.ratio[1] = 0.9  # the launch-bound loop turns GPU-bound
    # within 8 rounds of 2 s it is probed again, moves, and is back to every round
    start = max(prober.last_probed.values())
    _, now = run(prober, busy, {0, 1}, 40.0, start, until=lambda: prober.spacing.get(1) == 1)
    assert prober.spacing[1] == 1 and now - start <= 17.0 + PROBE_LEAD_S + PROBE_S + PROBE_READ_LAG_S + 0.01
    assert prober.busy_ratio[1] > 0.45  # halfway there after one probe (the running estimate)


def test_a_tenant_back_after_a_pause_is_probed_at_every_round_again():
    busy = Busy({0: 0.95, 1: 0.1})
    prober = Prober(Mask(), busy, every_s=1.0, backoff=8)
    run(prober, busy, {0, 1}, 60.0)
    assert prober.spacing == {0: 8, 1: 8}
    prober.next_probe({0}, 61.0)  # tenant 1 stopped launching
    prober.next_probe({0, 1}, 62.0)  # and is back
    assert prober.spacing == {0: 8}


def test_a_probe_that_saw_no_launch_leaves_the_estimate_alone():
    # a GPU-bound loop still warming up (or waiting for its start) when its first probe comes: read
    # as idle, it would run beside the holder for its first rounds
    busy = Busy({0: 0.0, 1: 0.95})
    prober = Prober(Mask(), busy, every_s=1.0, backoff=8)
    probes, _ = run(prober, busy, {0, 1}, 1.0)
    assert [s for _, s in probes][:2] == [0, 1]  # both probed once, tenant 0 while it launched nothing
    assert 0 not in prober.busy_ratio and 0 not in prober.launch_s
    assert prober.spacing[0] == 1  # probed again at its next turn
    busy.ratio[0] = 0.98  # it starts its loop
    run(prober, busy, {0, 1}, 4.0, start=1.0)
    assert prober.busy_ratio[0] == pytest.approx(0.98, abs=0.05)  # its first probe with launches


class Page:
    """A process page's counters, as ``ProcView.counter`` reads them."""

    def __init__(self, **counters: int) -> None:
        self.counters = counters

    def counter(self, name: str) -> int:
        return self.counters.get(name, 0)


def test_waits_under_way_count_up_to_now_and_a_torn_read_counts_none_of_them():
    joined = 1_000 * 10**9
    two_waiting = Page(started_ns=joined, sync_wait_ns=7, sync_open=2,
                       sync_open_since_ns=(joined + 10) + (joined + 20))
    assert waited_ns(two_waiting, joined + 100) == 7 + 90 + 80
    # the count read after one ended, the sum of starts before: as if one began before the process joined
    torn = Page(started_ns=joined, sync_wait_ns=7, sync_open=1,
                sync_open_since_ns=(joined + 10) + (joined + 20))
    assert waited_ns(torn, joined + 100) == 7
    # and the sum read after the last one ended, the count before
    assert waited_ns(Page(started_ns=joined, sync_wait_ns=7, sync_open=1), joined + 100) == 7
    # a count written by hand to pass the bound (the page is the tenant's): none of it
    forged = Page(started_ns=0, sync_wait_ns=7, sync_open=2**60, sync_open_since_ns=0)
    assert waited_ns(forged, joined) == 7
