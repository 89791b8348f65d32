"""The share controller's prober: the busy fraction of the tenants that run beside the holder.

A tenant beside the holder (higher priority, within its share) is never drained or timed, so what it
uses is estimated: now and then the controller pauses the holder (its queued work drained first) and
the tenants beside it time each launch, running alone; their busy time over the probe's wall time is
their busy fraction, folded into a running estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuscope.share.ledger import Policy
from gpuscope.share.processes import ProcessTable
from gpuscope.share.settings import PROBE_FIRST_S, PROBE_READ_LAG_S, PROBE_S

#: Weight of a new probe's busy fraction in the running estimate.
PROBE_WEIGHT = 0.5


@dataclass
class Probe:
    """A pause of the holder while the tenants beside it time their launches alone."""

    until: float
    started: float
    busy_ns: dict[int, int]  # slot -> its processes' busy_ns when the probe began
    read_at: float = 0.0  # once ended: when its windows have been posted


class Prober:
    def __init__(self, policy: Policy, table: ProcessTable, every_s: float) -> None:
        self.policy = policy
        self.table = table
        self.every_s = every_s
        self.busy_ratio: dict[int, float] = {}  # slot -> busy fraction measured in probes (beside tenants)
        self.probe: Probe | None = None
        self.next_probe = 0.0

    def newly_beside(self, slots: set[int], now: float) -> None:
        """``slots`` start running beside the holder: one never probed is probed soon."""
        if any(slot not in self.busy_ratio for slot in slots):
            first = now + PROBE_FIRST_S
            self.next_probe = first if self.next_probe <= now else min(self.next_probe, first)

    def due(self, now: float, beside: set[int]) -> bool:
        return bool(beside) and self.probe is None and now >= self.next_probe

    def start(self, beside: set[int], now: float) -> None:
        """Have ``beside`` time each launch from ``now`` (the holder already drained and paused)."""
        self.probe = Probe(until=now + PROBE_S, started=now, busy_ns=self.table.busy_ns(beside))
        self.policy.set_busy_mask(sum(1 << s for s in beside))

    def advance(self, now: float) -> float | None:
        """Move a probe along: end it when its time is up, read it once its windows are posted.
        Returns how long the running probe has left (the loop sleeps that long), else None."""
        probe = self.probe
        if probe is None:
            return None
        if probe.read_at == 0.0:  # running
            if now < probe.until:
                return probe.until - now
            self.policy.set_busy_mask(0)
            probe.until, probe.read_at = now, now + PROBE_READ_LAG_S
            self.next_probe = now + self.every_s
        elif now >= probe.read_at:
            self._read(probe)
        return None

    def _read(self, probe: Probe) -> None:
        """Each probed tenant's busy fraction, folded into its running estimate."""
        self.probe = None
        wall = max(probe.until - probe.started, 1e-6)
        after = self.table.busy_ns(set(probe.busy_ns))
        for slot, before in probe.busy_ns.items():
            measured = min(1.0, (after[slot] - before) / 1e9 / wall)
            old = self.busy_ratio.get(slot)
            self.busy_ratio[slot] = measured if old is None else old + PROBE_WEIGHT * (measured - old)

    def stop(self) -> None:
        if self.probe is not None:
            self.policy.set_busy_mask(0)
            self.probe = None
