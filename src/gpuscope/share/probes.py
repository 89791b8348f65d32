"""The share controller's prober: how busy each active tenant keeps the GPU when it runs alone.

Whether a tenant takes turns or runs beside the holder, and what a tenant beside the holder is
charged, depend on the part of the time its kernels keep the GPU busy (a launch-bound loop's events
would span the gaps between its kernels; a tenant beside the holder launches untimed). So now and
then the controller pauses the other tenants (their queued work drained first) and one tenant times
each launch, running alone; its busy time over the probe's wall time is its busy fraction, folded
into a running estimate. One tenant per probe, the one probed longest ago (one never probed first,
soon after it starts): probed together, tenants' kernels would wait for each other's and read busier
than they are. Tenants of higher priority than the probed one keep running (a latency tenant is never
paused for another's probe; the probed one then reads a little busy, never idle).

A probe begins with a lead of ``PROBE_LEAD_S`` in which the tenant runs alone as it launches anyway
(untimed beside the holder, in its usual windows taking turns): its launches a second and the part of
its time it waits for the GPU there are what its throughput beside the holder is estimated against
(``scheduler.beside_fraction``). Read while it timed each launch, they were read slow: two events and
their queries a launch cost a launch-bound loop a large part of its rate (on an H100 a compiled MLP
beside the holder was estimated at 0.18 of its alone rate where it ran at 0.10), so such a tenant
was never found starved.

A probe also gives the tenant's kernel time per launch (its busy time over the launches it timed):
beside the holder a tenant is charged that for each launch it makes, so a tenant slowed down beside
a GPU-bound holder (its kernels wait behind the holder's) is charged the kernels it ran, not its busy
fraction of the wall time as if it ran as fast as alone.

A probe in which the tenant launched nothing (it was loading, warming up or waiting for work) is
not folded in: it says nothing of how busy the tenant keeps the GPU when it runs, and a GPU-bound
loop read as idle would run beside the holder until later probes outweighed it. So a tenant that is
idle for long stretches is judged by the probes that caught it launching.

A probe pauses the others, so it costs them GPU time: a tenant whose probes agree with its estimate
(each within ``STABLE_DELTA`` of it) is probed half as often after each such probe, down to
``backoff`` times less often than the round; one whose probe moves the estimate is probed at the
round's rate again. A steady GPU-bound or launch-bound loop soon costs the others little; a tenant
whose busy fraction changes is followed as before.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from gpuscope.share.ledger import Policy
from gpuscope.share.processes import ProcessTable
from gpuscope.share.settings import PROBE_FIRST_S, PROBE_LEAD_S, PROBE_READ_LAG_S, PROBE_S

#: Weight of a new probe's busy fraction in the running estimate.
PROBE_WEIGHT = 0.5
#: A probe within this much of the running estimate agrees with it (a steady loop's probes differ by
#: a few hundredths; a loop with host gaps of the probe's length differs by tenths and is never
#: backed off).
STABLE_DELTA = 0.05


@dataclass
class Probe:
    """A pause of the other tenants while one tenant runs alone: a lead as it launches anyway, then
    timing each launch."""

    slot: int
    until: float  # the end of the phase under way (the lead's, then the timed part's)
    started: float  # when the phase under way began
    launches: int  # the slot's processes' launches as the lead began
    sync_wait_ns: int  # and their time in waits for the GPU
    busy_ns: int = 0  # their busy_ns as the timed part began
    busy_launches: int = 0  # and their launches timed on their own
    timed: bool = False  # the lead is over: each launch is timed
    read_at: float = 0.0  # once ended: when its windows have been posted


class Prober:
    def __init__(self, policy: Policy, table: ProcessTable, every_s: float, backoff: int = 1) -> None:
        self.policy = policy
        self.table = table
        self.every_s = every_s  # one probe of some tenant at most this often
        self.backoff = max(1, backoff)
        self.spacing: dict[int, int] = {}  # slot -> how many rounds apart its probes are (1..backoff)
        self.candidates: frozenset[int] = frozenset()  # the last candidates seen
        self.busy_ratio: dict[int, float] = {}  # slot -> busy fraction measured in its probes
        self.launch_s: dict[int, float] = {}  # slot -> kernel seconds a launch, measured in its probes
        self.wait_ratio: dict[int, float] = {}  # slot -> part of its probes' time spent in waits for the GPU
        self.launch_rate: dict[int, float] = {}  # slot -> its launches a second in its probes
        self.probe: Probe | None = None
        self.last_probed: dict[int, float] = {}  # slot -> when its last probe began
        self.first_seen: dict[int, float] = {}  # slot never probed -> when it was first a candidate
        self.last_end = float("-inf")

    def next_probe(self, candidates: Set[int], now: float) -> float:
        """When the next probe of one of ``candidates`` is due: ``PROBE_FIRST_S`` after a candidate
        never probed was first seen (and after the last probe); else when the first candidate's own
        turn comes (a round, ``every_s`` a candidate, times its spacing after its last probe), at least
        ``every_s`` after the last probe."""
        for slot in candidates - self.candidates:  # back after a pause: its workload may have changed
            self.spacing.pop(slot, None)
        self.candidates = frozenset(candidates)
        fresh = [s for s in candidates if s not in self.last_probed]
        for slot in fresh:
            self.first_seen.setdefault(slot, now)
        if fresh:
            first = min(self.first_seen[s] for s in fresh)
            return max(self.last_end, first) + PROBE_FIRST_S
        if not candidates:
            return self.last_end + self.every_s
        own = min(self._own_due(s, len(candidates)) for s in candidates)
        return max(self.last_end + self.every_s, own)

    def _own_due(self, slot: int, candidates: int) -> float:
        return self.last_probed[slot] + self.every_s * candidates * self.spacing.get(slot, 1)

    def due(self, now: float, candidates: Set[int]) -> int | None:
        """The slot to probe now, if a probe is due: the candidate never probed, else the one whose own
        turn came first (probed longest ago, where none is backed off)."""
        if self.probe is not None or not candidates or now < self.next_probe(candidates, now):
            return None
        if any(s not in self.last_probed for s in candidates):
            return min(candidates, key=lambda s: (s in self.last_probed, self.first_seen.get(s, now), s))
        return min(candidates, key=lambda s: (self._own_due(s, len(candidates)), s))

    def start(self, slot: int, now: float) -> float:
        """Have ``slot`` run alone from ``now`` (the others already drained and paused): its lead, then
        each launch timed (``advance``). Returns how long the lead lasts."""
        launches, waited_ns = self.table.launches(slot), self.table.sync_wait_ns(slot, now)
        self.probe = Probe(slot=slot, until=now + PROBE_LEAD_S, started=now, launches=launches,
                           sync_wait_ns=waited_ns)
        self.last_probed[slot] = now
        self.first_seen.pop(slot, None)
        return PROBE_LEAD_S

    def advance(self, now: float) -> float | None:
        """Move a probe along: from its lead to timing each launch, end it when its time is up, read it
        once its windows are posted. Returns how long the running phase has left (the loop sleeps that
        long), else None."""
        probe = self.probe
        if probe is None:
            return None
        if probe.read_at == 0.0:  # running
            if now < probe.until:
                return probe.until - now
            if not probe.timed:
                self._read_lead(probe, now)
                busy_ns, busy_launches = self.table.busy(probe.slot)
                probe.busy_ns, probe.busy_launches, probe.timed = busy_ns, busy_launches, True
                probe.started, probe.until = now, now + PROBE_S
                self.policy.set_busy_mask(1 << probe.slot)
                return PROBE_S
            self.policy.set_busy_mask(0)
            probe.until, probe.read_at = now, now + PROBE_READ_LAG_S
            self.last_end = now
        elif now >= probe.read_at:
            self._read(probe)
        return None

    def _read_lead(self, probe: Probe, now: float) -> None:
        """The part of its lead the tenant waited for the GPU, and its launches a second there, folded
        into running estimates (a lead in which it launched nothing says nothing of either)."""
        wall = max(now - probe.started, 1e-6)
        launches = self.table.launches(probe.slot) - probe.launches
        if launches <= 0:
            return
        # the part of its time alone it waited for the GPU (its syncs): what its waits beside the holder
        # are compared with (scheduler.beside_fraction)
        waited_ns = self.table.sync_wait_ns(probe.slot, now) - probe.sync_wait_ns
        waited = min(1.0, max(0, waited_ns) / 1e9 / wall)
        old_wait = self.wait_ratio.get(probe.slot)
        self.wait_ratio[probe.slot] = (waited if old_wait is None
                                       else old_wait + PROBE_WEIGHT * (waited - old_wait))
        # and its launches a second alone: what its launches beside the holder are compared with
        old_rate, launch_rate = self.launch_rate.get(probe.slot), launches / wall
        self.launch_rate[probe.slot] = (launch_rate if old_rate is None
                                        else old_rate + PROBE_WEIGHT * (launch_rate - old_rate))

    def _read(self, probe: Probe) -> None:
        """The probed tenant's busy fraction and kernel time a launch, folded into running estimates."""
        self.probe = None
        wall = max(probe.until - probe.started, 1e-6)
        busy_ns, busy_launches = self.table.busy(probe.slot)
        busy_s = max(0, busy_ns - probe.busy_ns) / 1e9  # an exit drops a process's counts
        launches = busy_launches - probe.busy_launches
        if launches <= 0:
            # It launched nothing while it ran alone (loading, warming up, waiting for its first
            # request): that says nothing of how busy it keeps the GPU when it runs. Folded in, one such
            # probe put two GPU-bound loops beside each other for their first seconds. Probed again
            # at its next turn, at the round's rate.
            self.spacing[probe.slot] = 1
            return
        measured = min(1.0, busy_s / wall)
        old = self.busy_ratio.get(probe.slot)
        self.busy_ratio[probe.slot] = measured if old is None else old + PROBE_WEIGHT * (measured - old)
        per_launch, old_per = busy_s / launches, self.launch_s.get(probe.slot)
        self.launch_s[probe.slot] = (per_launch if old_per is None
                                     else old_per + PROBE_WEIGHT * (per_launch - old_per))
        steady = old is not None and abs(measured - old) <= STABLE_DELTA
        spacing = self.spacing.get(probe.slot, 1)
        self.spacing[probe.slot] = min(2 * spacing, self.backoff) if steady else 1

    def stop(self) -> None:
        if self.probe is not None:
            self.policy.set_busy_mask(0)
            self.probe = None
