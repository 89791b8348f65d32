"""Who may launch next: pure decisions, no clocks or files (the controller feeds them).

Two policies on the same gate:

- ``SliceScheduler`` (``--share.accounting events``): one tenant holds the GPU at a time, in slices,
  whenever two or more want it. Each slice's GPU time, measured by the holder's CUDA events, is
  that tenant's own (nobody else had work queued), and is charged to it. The next holder is the
  tenant furthest below its share (deficit round robin on decayed GPU seconds), except that a
  higher-priority tenant still within its share goes first, as in the server's scheduler.
- ``TokenBuckets`` (``--share.accounting nvml``): what the peer projects do. Each tenant's bucket
  fills at its share and drains by its processes' NVML utilization, sampled every 100 ms; a tenant
  whose bucket is empty is held until it refills. Several tenants launch at once.

With one tenant (or none) wanting the GPU, neither binds: the gate is open for everyone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from gpuscope.share.ledger import TenantPolicy


class SliceScheduler:
    """Deficit round robin on measured GPU seconds, priorities first within their share."""

    def __init__(self, tenants: Sequence[TenantPolicy], *, memory_s: float = 2.0) -> None:
        if memory_s <= 0:
            raise ValueError("memory_s must be positive")
        self.tenants = list(tenants)
        self.memory_s = memory_s
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

    def binds(self, active: Iterable[int]) -> bool:
        """Whether shares bind: more than one tenant has been launching lately."""
        return len(set(active)) > 1

    def pick(self, wanting: Iterable[int], now: float,
             pending: Mapping[int, float] | None = None) -> int | None:
        """The slot that gets the next slice among those that want one (None: nobody wants one).

        ``pending``: GPU seconds a slot has used but not yet posted (the holder's running slice),
        counted as if charged, so the holder is not favoured by its own unposted time."""
        wanting = sorted(set(wanting))
        if not wanting:
            return None
        self._decay(now)
        saved = list(self.used)
        for slot, extra in (pending or {}).items():
            self.used[slot] += max(0.0, extra)
        try:
            eligible = [s for s in wanting if self.within_share(s, wanting)] or wanting
            top = max(self.tenants[s].priority for s in eligible)
            first = [s for s in eligible if self.tenants[s].priority == top]
            return min(first, key=lambda s: (self._ratio(s), s))
        finally:
            self.used = saved

    def quantum(self, slot: int, wanting: Iterable[int], base_s: float) -> float:
        """Slice length for ``slot``: ``base_s`` for the smallest share among ``wanting``, longer in
        proportion to the share (weighted round robin; the deficits correct what is left)."""
        smallest = min((self.tenants[s].share for s in wanting), default=self.tenants[slot].share)
        return base_s * min(8.0, self.tenants[slot].share / max(smallest, 1e-9))

    def preempts(self, holder: int, slot: int, wanting: Iterable[int]) -> bool:
        """Whether waiting ``slot`` should take the GPU from ``holder`` before its slice ends."""
        return (self.tenants[slot].priority > self.tenants[holder].priority
                and self.within_share(slot, wanting))


class TokenBuckets:
    """The peers' token bucket, fed by per-process NVML utilization (a fraction of the GPU)."""

    def __init__(self, tenants: Sequence[TenantPolicy], *, burst_s: float = 0.2) -> None:
        self.tenants = list(tenants)
        self.burst_s = burst_s
        self.tokens = [burst_s] * len(tenants)

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
        return mask or 0xFFFF
