"""Who may launch next: pure decisions, no clocks or files (the controller feeds them).

Two policies on the same gate:

- ``SliceScheduler`` (``--share.accounting events``): one tenant holds the GPU at a time, in slices,
  whenever two or more GPU-bound tenants want it. Each slice's GPU time, measured by the holder's CUDA
  events, is that tenant's own (nobody else had work queued), and is charged to it. The next holder
  is the tenant furthest below its share (deficit round robin on decayed GPU seconds). A tenant that
  leaves the GPU idle most of the time it runs (its probes show it busy at most half the time), or
  one of higher priority than the lowest active one that is within its share, runs *beside* the
  holder: its work is admitted at once, the GPU time-slices it with the holder's (filling the gaps
  between its kernels with the holder's), and it is charged its busy time. Holding the GPU alone,
  such a tenant would keep it idle between its kernels and be charged for the idle time.
- ``TokenBuckets`` (``--share.accounting nvml``): what the peer projects do. Each tenant's bucket
  fills at its share and drains by its processes' NVML utilization, sampled every 100 ms; a tenant
  whose bucket is empty is held until it refills. Several tenants launch at once.

With one tenant (or none) wanting the GPU, neither binds: the gate is open for everyone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set

from gpuscope.share.ledger import TenantPolicy

#: A tenant beside the holder is held to its share by a duty cycle (``SliceScheduler.duty``) up to
#: this many times its share of busy time, and while it keeps the GPU busy no more than
#: ``DUTY_MAX_BUSY`` of the time; beyond either it takes turns. A duty suits a latency-bound tenant
#: (its kernels fit between the holder's); a GPU-bound one, time-sliced with the holder during its
#: part of the time, would get about half of what it is charged.
DUTY_MAX_OVER = 2.0
DUTY_MAX_BUSY = 0.5
#: A tenant already beside the holder stays there until its busy time passes those limits by this
#: factor: probes vary by a few percent, and a tenant at the limit that moved between the duty and the
#: turns at each probe waited a whole turn of the holder now and then (docs/share.md, Limits).
DUTY_STAY_MARGIN = 1.25
#: The lone holder's duty follows its throughput (``SliceScheduler.lone_holder_duty``) by at most this
#: factor per judgement: a throughput read over a second moves by a few percent on its own.
LONE_STEP = 1.5
#: ... and aims its throughput this much above its fair share: read from its launches a second against
#: those of its probes' timed part, where an event around each launch slows it, the estimate reads
#: high (0.29-0.30 where it did 0.22-0.26 on the CPU host's fake GPU), and a share is a floor.
LONE_AIM = 1.25


class SliceScheduler:
    """Deficit round robin on measured GPU seconds, priorities first within their share."""

    def __init__(self, tenants: Sequence[TenantPolicy], *, memory_s: float = 2.0,
                 starved_below: float = 0.0) -> None:
        """``starved_below``: the part of its fair share under which a tenant beside the holder is
        ``starved`` (``--share.starved-below``; 0: never)."""
        if memory_s <= 0:
            raise ValueError("memory_s must be positive")
        self.tenants = list(tenants)
        self.memory_s = memory_s
        self.starved_below = starved_below
        self.used = [0.0] * len(tenants)  # decayed GPU seconds
        self._last = 0.0

    def _decay(self, now: float) -> None:
        if now > self._last:
            factor = math.exp(-(now - self._last) / self.memory_s)
            self.used = [u * factor for u in self.used]
            self._last = now

    def charge(self, slot: int, gpu_s: float, now: float) -> None:
        """Add a slice's measured GPU time to tenant ``slot``."""
        self._decay(now)
        self.used[slot] += max(0.0, gpu_s)

    def _ratio(self, slot: int) -> float:
        return self.used[slot] / max(self.tenants[slot].share, 1e-9)

    def within_share(self, slot: int, wanting: Iterable[int]) -> bool:
        """Whether ``slot`` has used no more than its share of what the tenants in ``wanting`` used."""
        wanting = list(wanting)
        total_used = sum(self.used[s] for s in wanting)
        total_share = sum(self.tenants[s].share for s in wanting)
        if total_used <= 0 or total_share <= 0:
            return True
        return self.used[slot] / total_used <= self.tenants[slot].share / total_share + 1e-9

    def beside(self, active: Iterable[int], busy: Mapping[int, float] | None = None,
               now_beside: Set[int] = frozenset(), to_turns: Set[int] = frozenset()) -> set[int]:
        """Tenants that run beside the slice holder instead of taking turns (``busy``: the fraction of
        the time each one kept the GPU busy in its probes; ``now_beside``: those beside now, which stay
        up to ``DUTY_STAY_MARGIN`` past the limits, so that probe noise does not move them back and
        forth; ``to_turns``: those found ``starved`` beside the holder lately, which take turns
        whatever their probes say, unless their priority lets them beside). Among the ``active``
        tenants, two kinds:

        - one that leaves the GPU idle most of the time it runs (a launch-bound inference loop, a
          training step with host work, a decode loop): busy for no more than its share, or up to
          ``DUTY_MAX_OVER`` times it (held to its share by ``duty``), and in either case at most
          ``DUTY_MAX_BUSY`` of the time. Taking turns it would hold the GPU idle between its kernels
          and be charged for it; beside the holder the GPU fills those gaps with the holder's work.
        - one of higher priority than the lowest among ``active``: within its share of what the
          active tenants used, or busy for no more than its share, or for up to ``DUTY_MAX_OVER``
          times it and at most ``DUTY_MAX_BUSY``. The first needs no probe (a latency tenant runs
          beside from its first launch); the second keeps it from being trapped in turns: taking turns
          it is charged its holding time, which is its share, so it would never fall back within it.

        A tenant never probed takes turns unless its priority lets it beside."""
        active = set(active)
        if len(active) < 2:
            return set()
        busy = busy or {}
        low = min(self.tenants[s].priority for s in active)

        def limit(s: int) -> float:
            return DUTY_STAY_MARGIN if s in now_beside else 1.0

        def idles(s: int) -> bool:  # leaves the GPU idle most of the time it runs
            fair = self.fair_fraction(s, active)
            return (s in busy and s not in to_turns
                    and busy[s] <= limit(s) * min(max(fair, DUTY_MAX_OVER * fair), DUTY_MAX_BUSY))

        def fits(s: int) -> bool:
            fair = self.fair_fraction(s, active)
            return s in busy and busy[s] <= max(fair, limit(s) * min(DUTY_MAX_OVER * fair, DUTY_MAX_BUSY))

        return {s for s in active
                if idles(s) or (self.tenants[s].priority > low and (self.within_share(s, active) or fits(s)))}

    def starved(self, slot: int, active: Iterable[int], throughput: float | None) -> bool:
        """Whether tenant ``slot``, beside the holder with nothing holding it back (no duty), runs at
        less than ``starved_below`` of its fair share of its alone throughput (``throughput``, as the
        controller estimates it: ``beside_fraction``): taking turns, it would have the GPU to itself
        for its share of the time, and run at its alone rate then. A launch-bound loop that syncs
        every step waits behind a GPU-bound holder's queue and time-slice at each step: on an H100 a
        compiled MLP of 0.2 share beside training and an encoder did 0.12 of its alone rate, as
        unmanaged, charged well under its share. The margin under the fair share keeps a tenant near it
        beside (a training loop that time-slicing alone gives 0.695 on a 0.7 share). A tenant of higher
        priority than the lowest active one is beside by its priority and is never starved: its
        requests (an open loop) may simply be fewer than it could serve."""
        active = set(active)
        low = min(self.tenants[s].priority for s in active | {slot})
        if not self.starved_below or throughput is None or self.tenants[slot].priority > low:
            return False
        return throughput < self.starved_below * self.fair_fraction(slot, active)

    def fair_fraction(self, slot: int, active: Iterable[int]) -> float:
        """``slot``'s share of the GPU among the ``active`` tenants."""
        total_share = sum(self.tenants[s].share for s in set(active) | {slot})
        return self.tenants[slot].share / max(total_share, 1e-9)

    def duty(self, slot: int, active: Iterable[int], busy: float | None,
             demand: Mapping[int, float] | None = None, rate: float | None = None,
             current: float = 1.0) -> float:
        """The part of the time tenant ``slot``, beside the holder and busy ``busy`` of the time it
        launches, may launch: all of it while that fits its share, else its share over what it needs
        (a decode loop that needs 40% of the GPU on a 30% share runs 75% of the time, its steps about
        a third slower, rather than waiting for the holder's turns).

        ``demand``: the busy fraction of the active tenants probed so far. While their summed demand
        (an unprobed one counted as keeping the GPU busy) fits the GPU, nobody is held back: a
        tenant over its share then uses time that nobody else wants.

        ``rate``: the part of the GPU's time it was charged lately (its launches beside the holder at
        its probed kernel time a launch), under its ``current`` duty. What it needs is the lesser of
        its probed busy fraction and that rate over its duty: a probe shows how busy it keeps the GPU
        running alone, flat out, but an open-loop tenant (requests at a fixed rate) probed while a
        duty has let its requests queue up runs flat out through the probe and reads busier than its
        requests make it, and a launch-bound tenant slowed beside a GPU-bound holder uses less than
        it would alone. Held by its probe alone, either was held under its share of the GPU's time."""
        active = set(active)
        fair = self.fair_fraction(slot, active)
        if busy is None or busy <= fair:
            return 1.0
        if demand is not None and sum(demand.get(s, 1.0) for s in active | {slot}) <= 1.0:
            return 1.0
        need = busy if rate is None or current <= 0 else min(busy, rate / current)
        if need <= fair:
            return 1.0
        return max(1.0 / (DUTY_MAX_OVER * DUTY_STAY_MARGIN), fair / need)

    def lone_holder_duty(self, slot: int, beside: Iterable[int], busy: Mapping[int, float],
                         throughput: float | None = None, current: float = 1.0) -> float:
        """The part of the time ``slot`` may launch as the one tenant taking turns while every other
        active one (``beside``) runs beside it (``--share.lone-holder duty``): all of it while their
        summed demand fits the GPU, else the time the others leave, at least its fair share, over the
        part of the time it keeps the GPU busy (``busy``: each one's probed busy fraction). Nobody
        waits for its turns, so nothing else holds it to its share: holding the GPU all the time, an
        encoder of share 0.3 beside a training loop and a launch-bound MLP did 0.51 of its alone rate
        and the MLP 0.15 on its 0.2 (an H100, docs/share.md, Limits). Under its duty the others run
        alone for the rest of each period.

        ``throughput``: its throughput as a fraction of its alone rate lately, under its ``current``
        duty. Its part of the time is not its part of the GPU: the others run beside it in its part
        too, and on the fake GPU of the CPU host a GPU-bound holder at a duty of its share over its
        busy fraction did 0.25 of its alone rate on a 0.3 share. So the duty is also at least what
        would bring that throughput to ``LONE_AIM`` times its fair share were it proportional to the
        duty (moved at most ``LONE_STEP`` times per call).

        Not while a tenant beside it has a higher priority (a latency tenant's requests, fewer than
        its probe's flat-out run: ``duty`` holds that one, and the holder's queue is kept short
        beside it), nor before every one has been probed."""
        beside = set(beside) - {slot}
        if not beside or slot not in busy or any(s not in busy for s in beside):
            return 1.0
        if any(self.tenants[s].priority > self.tenants[slot].priority for s in beside):
            return 1.0
        others = sum(busy[s] for s in beside)
        if others + busy[slot] <= 1.0:
            return 1.0
        fair = self.fair_fraction(slot, beside | {slot})
        duty = max(fair, 1.0 - others) / max(busy[slot], 1e-9)
        if throughput is not None and current > 0:
            proportional = current * LONE_AIM * fair / max(throughput, 1e-3)
            duty = max(duty, min(current * LONE_STEP, max(current / LONE_STEP, proportional)))
        return min(1.0, duty)

    def binds(self, active: Iterable[int]) -> bool:
        """Whether shares bind: more than one tenant has been launching lately."""
        return len(set(active)) > 1

    def usage(self, now: float, pending: Mapping[int, float] | None = None) -> list[float]:
        """Each tenant's decayed GPU seconds at ``now``, with ``pending`` (used, not yet posted) added."""
        self._decay(now)
        used = list(self.used)
        for slot, extra in (pending or {}).items():
            used[slot] += max(0.0, extra)
        return used

    def pick(self, wanting: Iterable[int], now: float,
             pending: Mapping[int, float] | None = None) -> int | None:
        """The slot that gets the next slice among those that want one (None: nobody wants one).

        ``pending``: GPU seconds a slot has used but not yet posted (the holder's running slice),
        counted as if charged, so the holder is not favoured by its own unposted time."""
        wanting = sorted(set(wanting))
        if not wanting:
            return None
        saved = self.used
        self.used = self.usage(now, pending)
        try:
            eligible = [s for s in wanting if self.within_share(s, wanting)] or wanting
            top = max(self.tenants[s].priority for s in eligible)
            first = [s for s in eligible if self.tenants[s].priority == top]
            return min(first, key=lambda s: (self._ratio(s), s))
        finally:
            self.used = saved

    def keeps_claim(self, slot: int, wanting: Iterable[int], now: float,
                    pending: Mapping[int, float] | None = None) -> bool:
        """Whether ``slot``, idle as its turn ends (or lent), keeps its claim on the GPU while the
        tenants in ``wanting`` wait: it is within its share and the pick would be its own. Its next
        turn is then lent to them at once, and its next launch takes it back; a tenant over its share
        has no claim. The turn keeper in C decides the same (_turns.c, keep)."""
        wanting = set(wanting) - {slot}
        if not wanting:
            return False
        saved = self.used
        self.used = self.usage(now, pending)
        try:
            within = self.within_share(slot, wanting | {slot})
        finally:
            self.used = saved
        return within and self.pick(wanting | {slot}, now, pending) == slot

    def quantum(self, slot: int, wanting: Iterable[int], base_s: float) -> float:
        """Slice length for ``slot``: ``base_s`` for the smallest share among ``wanting``, longer in
        proportion to the share (weighted round robin; the deficits correct what is left). A tenant
        without a share (removed from the policy while it runs) gets ``base_s`` and sets no scale."""
        shares = [self.tenants[s].share for s in {*wanting, slot} if self.tenants[s].share > 0]
        smallest = min(shares, default=0.0)
        ratio = self.tenants[slot].share / smallest if smallest > 0 else 1.0
        return base_s * min(8.0, max(1.0, ratio))

    def set_tenants(self, tenants: Sequence[TenantPolicy]) -> None:
        """A new policy: the same slots first (their usage kept), new ones after."""
        self.tenants = list(tenants)
        self.used += [0.0] * (len(self.tenants) - len(self.used))

    def preempts(self, holder: int, slot: int, wanting: Iterable[int]) -> bool:
        """Whether waiting ``slot`` should take the GPU from ``holder`` before its slice ends."""
        return (self.tenants[slot].priority > self.tenants[holder].priority
                and self.within_share(slot, wanting))


def waits_throughput(waiting_alone: float, waiting_now: float) -> float | None:
    """A loop's throughput as a fraction of its alone rate, from the part of its wall time it spends
    waiting for the GPU (its syncs) running alone (probed) and now: each step is its host work and a
    wait, and only the wait grows when its kernels queue behind another tenant's, so its step time
    grows by (1 - waiting_alone) / (1 - waiting_now). A loop slowed on the host (its host work grown:
    a busy CPU) waits less, and reads as no slower here: turns would not help it. None where it waits
    for the GPU nearly all the time alone (nothing to compare)."""
    if waiting_alone >= 0.95:
        return None
    return max(0.0, 1.0 - min(1.0, waiting_now)) / (1.0 - max(0.0, waiting_alone))


def beside_fraction(waiting_alone: float, waiting_now: float, launch_ratio: float | None) -> float | None:
    """A tenant's throughput beside the holder as a fraction of its alone rate, from its waits for the
    GPU (``waits_throughput``) and, where it waits more than alone, from its launches a second against
    its probes' (``launch_ratio``): the lesser of the two.

    Either alone misreads. A probe of 20 ms that wakes late from its syncs (a busy host, on a step of
    150 µs of kernel) reads the tenant waiting 0.87-0.90 of its time alone where it waits 0.6: its
    waits beside the holder, 0.94, then say 0.6 of its alone rate where its steps ran at 0.06. Its
    launches say 0.06. But launches also fall when a tenant simply has less to do (fewer requests, a
    longer data-loading gap): it then waits less than alone, and only its waits are read."""
    from_waits = waits_throughput(waiting_alone, waiting_now)
    if launch_ratio is None or waiting_now <= waiting_alone:
        return from_waits
    launch_ratio = max(0.0, launch_ratio)
    return launch_ratio if from_waits is None else min(from_waits, launch_ratio)


def split_overlap(posted: Mapping[int, float], wall_s: float) -> dict[int, float]:
    """Each tenant's own GPU time from event time posted while tenants ran at once.

    Without MPS the GPU time-slices contexts that both have work, in equal turns, and each one's
    events span the other's turns: what they post over ``wall_s`` sums to more than ``wall_s`` by the
    time they overlapped. During an overlap each had half of the GPU, so each is charged its posted
    time less an equal part of the excess, never less than half of what it posted (exact for two
    tenants; with more it assumes the excess overlapped evenly)."""
    total = sum(posted.values())
    excess = total - wall_s
    if excess <= 0 or total <= 0:
        return dict(posted)
    out = dict(posted)
    open_slots = [s for s, v in posted.items() if v > 0]
    while excess > 1e-12 and open_slots:
        each = excess / len(open_slots)
        still = []
        for slot in open_slots:
            room = out[slot] - posted[slot] / 2  # what may still be taken from this tenant
            take = min(each, room)
            out[slot] -= take
            excess -= take
            if room > each:
                still.append(slot)
        open_slots = still
    left = sum(out.values())
    if left > wall_s > 0:  # more than twice the wall time (several streams each): no better guess
        out = {slot: v * wall_s / left for slot, v in out.items()}
    return out


def own_time(posted: Mapping[int, float], wall_s: float, exact: Set[int] = frozenset()) -> dict[int, float]:
    """What each tenant is charged for time it posted over ``wall_s`` while tenants ran at once.

    ``exact``: tenants whose posted time is their kernels' own (a window per launch, beside the
    holder); the others' windows span whatever the GPU ran in between, so they share what is left of
    the wall time after the exact ones (``split_overlap``)."""
    exact_total = sum(v for slot, v in posted.items() if slot in exact)
    if exact_total >= wall_s > 0:
        return {slot: (v * wall_s / exact_total if slot in exact else 0.0) for slot, v in posted.items()}
    out = split_overlap({slot: v for slot, v in posted.items() if slot not in exact}, wall_s - exact_total)
    out.update({slot: v for slot, v in posted.items() if slot in exact})
    return out


class TokenBuckets:
    """The peers' token bucket, fed by per-process NVML utilization (a fraction of the GPU)."""

    def __init__(self, tenants: Sequence[TenantPolicy], *, burst_s: float = 0.2) -> None:
        self.tenants = list(tenants)
        self.burst_s = burst_s
        self.tokens = [burst_s] * len(tenants)

    def set_tenants(self, tenants: Sequence[TenantPolicy]) -> None:
        """A new policy: the same slots first (their buckets kept), new ones after."""
        self.tenants = list(tenants)
        self.tokens += [self.burst_s] * (len(self.tenants) - len(self.tokens))

    def update(self, utilization: Mapping[int, float], wanting: Iterable[int], dt_s: float) -> int:
        """Refill by share, drain by measured utilization over ``dt_s``; returns the gate mask."""
        wanting = set(wanting)
        for slot, tenant in enumerate(self.tenants):
            used = utilization.get(slot, 0.0) * dt_s
            level = self.tokens[slot] + tenant.share * dt_s - used
            self.tokens[slot] = max(-self.burst_s, min(self.burst_s, level))
        if len(wanting) <= 1:
            return 0xFFFF
        mask = 0
        for slot in range(len(self.tenants)):
            if slot not in wanting or self.tokens[slot] >= 0:
                mask |= 1 << slot
        # every tenant over: all are held until their buckets refill, as each peer's limiter holds its
        # own processes (NVML's per-process utilization counts a time-sliced context busy for the
        # whole time the GPU alternates, so two busy tenants each read close to 100%)
        return mask
