"""The scheduler's policy, driven directly with synthetic GPU-time charges."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gpuscope.server.config import ConfigError, parse_tenants
from gpuscope.server.scheduler import QueueFull, Scheduler


@dataclass(eq=False)
class Req:
    tenant: str
    arrival: float = 0.0
    seq: int = 0
    cancelled: bool = False
    generated: list = field(default_factory=list)


def simulate(scheduler: Scheduler, slots: int, steps: int, cost: dict[str, float] | None = None):
    """Saturating closed loop: every tenant always has work; each running request lives 4 steps."""
    tenants = list(scheduler.state())
    for t in tenants:
        for _ in range(slots * 2):
            scheduler.submit(Req(t))
    running: list[tuple[Req, int]] = []
    for _ in range(steps):
        for req in scheduler.pick(slots - len(running)):
            running.append((req, 4))
        tokens: dict[str, int] = {}
        for req, _ in running:
            tokens[req.tenant] = tokens.get(req.tenant, 0) + 1
        seconds = sum((cost or {}).get(t, 1.0) * n for t, n in tokens.items()) * 1e-3
        scheduler.charge(tokens, seconds)
        left = []
        for req, ttl in running:
            if ttl > 1:
                left.append((req, ttl - 1))
            else:
                scheduler.finished(req)
                scheduler.submit(Req(req.tenant))
        running = left
    return scheduler.gpu_seconds()


def shares(used: dict[str, float]) -> dict[str, float]:
    total = sum(used.values())
    return {t: v / total for t, v in used.items()}


def test_gpu_time_follows_shares_under_saturation():
    got = shares(simulate(Scheduler(parse_tenants("a:0.7,b:0.3"), "share", 1000), slots=8, steps=2000))
    assert got["a"] == pytest.approx(0.7, abs=0.02)


def test_shares_hold_when_one_tenants_work_costs_more_per_token():
    # b's tokens cost 3x as much GPU time: slots alone would give b 56%; GPU-time fairness gives 30%.
    got = shares(simulate(Scheduler(parse_tenants("a:0.7,b:0.3"), "share", 1000), slots=8, steps=3000,
                          cost={"a": 1.0, "b": 3.0}))
    assert got["b"] == pytest.approx(0.3, abs=0.02)


def test_fcfs_ignores_shares():
    s = Scheduler(parse_tenants("a:0.9,b:0.1"), "fcfs", 100)
    order = [Req("b"), Req("a"), Req("b")]
    for r in order:
        s.submit(r)
    assert s.pick(3) == order
    assert s.state()["a"].quota == 0


def test_full_queue_raises_with_retry_after():
    s = Scheduler(parse_tenants("a:1"), "share", 2)
    s.submit(Req("a"))
    s.submit(Req("a"))
    with pytest.raises(QueueFull) as info:
        s.submit(Req("a"))
    assert 1 <= info.value.retry_after <= 60


def test_idle_tenant_banks_no_credit():
    s = Scheduler(parse_tenants("a:0.5,b:0.5"), "share", 1000)
    s.submit(Req("a"))
    [req] = s.pick(1)
    s.charge({"a": 1}, 100.0)  # a ran alone for a long time while b was idle
    s.finished(req)
    s.submit(Req("a"))
    s.submit(Req("b"))  # b comes back: it starts level with a, not 100 s ahead
    picks = [s.pick(1)[0].tenant for _ in range(2)]
    assert sorted(picks) == ["a", "b"]


def test_high_priority_preempts_lower_class_only_within_its_share():
    s = Scheduler(parse_tenants("hi:0.5:high,lo:0.5:low"), "share", 100)
    lo_reqs = [Req("lo") for _ in range(2)]
    for r in lo_reqs:
        s.submit(r)
    running = s.pick(2)
    s.charge({"lo": 2}, 1.0)
    s.submit(Req("hi"))
    victim, started = s.preempt(running)
    assert started.tenant == "hi" and victim in lo_reqs
    assert s.state()["lo"].preemptions == 1 and s.state()["lo"].queued == 1
    # Once hi is far over its share, it no longer preempts.
    s.charge({"hi": 1}, 50.0)
    s.submit(Req("hi"))
    assert s.preempt([r for r in running if r is not victim]) is None


def test_lower_class_joins_paced_while_higher_class_runs():
    # Each join is an extra prefill step for the running high-priority requests: lower classes
    # join at most every join_every iterations (all at once), and freely once it has finished.
    s = Scheduler(parse_tenants("hi:0.5:high,lo:0.5:low"), "share", 100, join_every=3)
    s.submit(Req("hi"))
    [hi] = s.pick(1)                                      # iteration 1
    for _ in range(6):
        s.submit(Req("lo"))
    assert [r.tenant for r in s.pick(2)] == ["lo", "lo"]  # iteration 2: one batch of joins
    assert s.pick(1) == [] and s.pick(1) == []            # iterations 3, 4: paced
    assert len(s.pick(1)) == 1                            # iteration 5
    assert s.pick(1) == []
    s.finished(hi)
    assert len(s.pick(3)) == 3


def test_paced_lower_class_keeps_a_shared_batch_so_high_priority_stays_within_share():
    # Launch-bound steps (cost independent of rows): shutting the flood out would leave the high
    # tenant paying whole steps alone; pacing keeps it cheap, so it keeps its preemption right.
    s = Scheduler(parse_tenants("hi:0.5:high,lo:0.5:low"), "share", 1000, join_every=8)
    running, waits, arrived = [], [], {}
    for _ in range(64):
        s.submit(Req("lo"))
    running += s.pick(8)
    for step in range(400):
        if step % 20 == 0:
            req = Req("hi")
            arrived[req] = step
            s.submit(req)
        new = s.pick(8 - len(running))
        while len(running) + len(new) >= 8 and s.waiting():
            swap = s.preempt(running)
            if swap is None:
                break
            running.remove(swap[0])
            new.append(swap[1])
        running += new
        waits += [step - arrived[r] for r in new if r.tenant == "hi"]
        tokens: dict[str, int] = {}
        for r in running:
            tokens[r.tenant] = tokens.get(r.tenant, 0) + 1
        s.charge(tokens, 1e-3)
        for r in running:
            r.generated.append(0)
        for r in [r for r in running if len(r.generated) >= 8]:
            running.remove(r)
            s.finished(r)
            if r.tenant == "lo":
                s.submit(Req("lo"))
    state = s.diagnostics()
    assert state["virtual_time_s"]["hi"] <= state["virtual_time_s"]["lo"]
    assert len(waits) == 20 and max(waits) == 0  # every hi request started in its arrival iteration


def test_starved_tenant_is_not_served():
    s = Scheduler(parse_tenants("a:0.5,b:0.5"), "share", 100)
    s.set_starved("b")
    s.submit(Req("b"))
    assert s.pick(1) == []
    s.set_starved(None)
    assert len(s.pick(1)) == 1


@pytest.mark.parametrize("text, unknown, message", [
    ("a", "reject", "not NAME:SHARE"),
    ("a:x", "reject", "is not a number"),
    ("a:0", "reject", "must be in (0, 1]"),
    ("a:0.5:urgent", "reject", "must be high, normal or low"),
    ("a:0.5,a:0.5", "reject", "twice"),
    ("a:0.7,b:0.7", "reject", "sum to 1.4"),
    ("a:1", "other", "no share is left for 'other'"),
    ("a b:1", "reject", "must be 1-64"),
])
def test_bad_tenant_specs_name_the_problem(text, unknown, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_tenants(text, unknown)


def test_tenant_spec_normalizes_and_adds_other():
    specs = {t.name: t for t in parse_tenants("a:0.6:high", "other")}
    assert specs["a"].share == pytest.approx(0.6) and specs["other"].share == pytest.approx(0.4)
    assert specs["other"].priority == "low"
    assert parse_tenants("a:0.2,b:0.2")[0].share == pytest.approx(0.5)
