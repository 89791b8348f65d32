"""The share controller's charging: the GPU time tenant processes posted, turned into charges.

The preload library posts each accounting window's GPU time to its process's page; the charger reads
what is new since its last call and charges it to the tenant's slot in the scheduler. While one tenant
holds the GPU alone what it posts is its own. While several run at once (the open gate, tenants beside
the holder, or an overlapping hand-over) their event spans overlap whenever the GPU time-slices them,
so what they post over a period is corrected by ``own_time`` before it is charged.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuscope.share.processes import ProcessTable
from gpuscope.share.scheduler import SliceScheduler, own_time

#: While tenants run concurrently their posted GPU time is summed over at least this long and, when
#: it exceeds the wall time (time-sliced contexts' event spans overlap), the overlap is split.
CONCURRENT_PERIOD_S = 0.05


class Charger:
    def __init__(self, table: ProcessTable, scheduler: SliceScheduler, charged_s: dict[str, float],
                 now: float) -> None:
        """``charged_s``: GPU seconds charged by tenant, after correction (what /metrics shows)."""
        self.table = table
        self.scheduler = scheduler
        self.charged_s = charged_s
        self.last_charge = now
        self.slice_start = 0.0
        self.posted_in_slice = 0.0  # what the holder's processes posted since its slice began
        self._unscaled: dict[int, float] = {}  # GPU seconds posted while tenants ran concurrently
        self._unscaled_since: float | None = None

    def start_slice(self, now: float) -> None:
        self.slice_start, self.posted_in_slice = now, 0.0

    def pending(self, now: float, holder: int | None) -> dict[int, float]:
        """The holder's slice so far, less what its processes already posted: its unposted GPU time
        (at most the slice's wall time, since it held the GPU alone)."""
        if holder is None:
            return {}
        return {holder: max(0.0, now - self.slice_start - self.posted_in_slice)}

    def charge(self, now: float, *, holder: int | None, beside_launch_s: Mapping[int, float],
               concurrent: bool, gate_open: bool, holding_scale: Mapping[int, float] | None = None) -> None:
        """Charge the GPU time the processes posted since the last call.

        ``beside_launch_s``: for each tenant beside the holder, the kernel seconds a launch of its took
        in its probes: only its probes post, so it is charged that for each launch it made (kernels
        that wait behind the holder's take no longer on the GPU, and a duty's pauses make none);
        ``holding_scale``: tenants taking turns that are charged their holding time, not their
        kernels': what they post times the factor (one over their probed busy fraction);
        ``concurrent``: whether several tenants ran at once since the last call; ``gate_open``: whether
        shares do not bind (what is posted is shown but held against nobody)."""
        since, self.last_charge = self.last_charge, now
        posted: dict[int, float] = {}
        for state in self.table:
            slot = state.view.slot
            gpu_ns, launches = state.view.counter("gpu_ns"), state.view.counter("launches")
            new_launches, state.launches_seen = max(0, launches - state.launches_seen), launches
            if slot in beside_launch_s:  # only probes post: their kernel time a launch stands for them
                if new_launches:
                    posted[slot] = posted.get(slot, 0.0) + beside_launch_s[slot] * new_launches
            elif gpu_ns > state.gpu_ns_seen:
                scale = (holding_scale or {}).get(slot, 1.0)
                posted[slot] = posted.get(slot, 0.0) + scale * (gpu_ns - state.gpu_ns_seen) / 1e9
            state.gpu_ns_seen = max(state.gpu_ns_seen, gpu_ns)
        if not concurrent and self._unscaled_since is None:
            self._apply(posted, now, holder, gate_open)
            return
        if self._unscaled_since is None:
            self._unscaled_since = since
        for slot, seconds in posted.items():
            self._unscaled[slot] = self._unscaled.get(slot, 0.0) + seconds
        wall = now - self._unscaled_since
        if concurrent and wall < CONCURRENT_PERIOD_S:
            return
        self._apply(own_time(self._unscaled, wall, set(beside_launch_s)), now, holder, gate_open)
        self._unscaled, self._unscaled_since = {}, (now if concurrent else None)

    def _apply(self, charged: Mapping[int, float], now: float, holder: int | None, gate_open: bool) -> None:
        for slot, seconds in charged.items():
            self.charged_s[self.table.tenant_name(slot)] += seconds
            if gate_open:
                # With the gate open every tenant's windows span the others' work (and a latency-bound
                # tenant's its own idle gaps): shown, but not held against anyone once shares bind.
                continue
            self.scheduler.charge(slot, seconds, now)
            if slot == holder:
                self.posted_in_slice += seconds
