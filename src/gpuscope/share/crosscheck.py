"""Tenants' self-reported GPU time against NVML's view of their processes.

A tenant's GPU time comes from its own processes' CUDA events; a process that rewrites its page can
under-report it and get more than its share. NVML's per-process utilization does not depend on what
tenants say. It is coarse (its samples are the SM-busy fraction of whatever the process ran over the
sampling period, and under time-slicing a waiting context can read busy), so the two are compared
over minutes, and a tenant is flagged only when NVML sees it use more than it was charged by more
than ``tolerance`` of the window's wall time. Under-reporting is what a tenant gains from; NVML
reading lower than the charge is not flagged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from gpuscope.share.nvml_source import process_samples

#: How far back the comparison looks, and by how much of that wall time NVML may exceed the charge.
WINDOW_S, TOLERANCE = 300.0, 0.15
#: How often NVML's per-process utilization is read: each call costs the controller milliseconds of
#: CPU (docs/share.md, "Security model"), and over minutes every 5 s is as good as more often.
SAMPLE_EVERY_S = 5.0


def nvml_mean_utilization(index: int) -> Callable[[], dict[int, float]]:
    """pid -> mean SM-busy fraction over NVML's samples since the last call, on GPU ``index``."""
    samples = process_samples(index)

    def read() -> dict[int, float]:
        by_pid: dict[int, list[float]] = {}
        for s in samples():
            by_pid.setdefault(s.pid, []).append(s.smUtil / 100.0)
        return {pid: sum(v) / len(v) for pid, v in by_pid.items()}

    return read


class ReportCheck:
    """Accumulates NVML busy seconds per tenant and flags those that NVML sees using far more."""

    def __init__(self, *, window_s: float = WINDOW_S, tolerance: float = TOLERANCE,
                 log: Callable[[str], None] | None = None) -> None:
        self.window_s = window_s
        self.tolerance = tolerance
        self.log = log or (lambda line: None)
        self.nvml_busy_s: dict[str, float] = {}  # tenant -> NVML-seen busy seconds (a counter)
        self.flagged: dict[str, bool] = {}
        self._history: dict[str, deque[tuple[float, float, float]]] = {}  # (time, nvml, charged)
        self._last: float | None = None
        self._logged: set[str] = set()

    def sample(self, now: float, utilization: Mapping[int, float], tenant_of: Mapping[int, str],
               charged_s: Mapping[str, float]) -> None:
        """``utilization``: pid -> SM-busy fraction since the last sample; ``tenant_of``: the joined
        processes' tenants; ``charged_s``: each tenant's charged GPU seconds so far (a counter)."""
        dt = 0.0 if self._last is None else max(0.0, now - self._last)
        self._last = now
        for pid, fraction in utilization.items():
            tenant = tenant_of.get(pid)
            if tenant is not None:
                self.nvml_busy_s[tenant] = self.nvml_busy_s.get(tenant, 0.0) + min(1.0, fraction) * dt
        for tenant, charged in charged_s.items():
            history = self._history.setdefault(tenant, deque())
            history.append((now, self.nvml_busy_s.get(tenant, 0.0), charged))
            while history and now - history[0][0] > self.window_s:
                history.popleft()
            then, nvml0, charged0 = history[0]
            span = now - then
            # judged only over (nearly) a whole window: a short one is all noise
            seen = span >= 0.9 * self.window_s
            excess = (self.nvml_busy_s.get(tenant, 0.0) - nvml0) - (charged - charged0)
            self.flagged[tenant] = seen and excess > self.tolerance * span
            if self.flagged[tenant] and tenant not in self._logged:
                self._logged.add(tenant)
                self.log(f"gpuscope share: NVML saw tenant {tenant}'s processes busy {excess:.0f} s more "
                         f"than they reported over {span:.0f} s: a process may under-report its GPU time")
