"""``/metrics`` of the share controller: the tenants' counters, read from their ledger slots."""

from __future__ import annotations

from collections.abc import Iterator

from gpuscope.contract import catalogue as cat
from gpuscope.share.controller import Controller
from gpuscope.share.crosscheck import ReportCheck
from gpuscope.share.unmanaged import UnmanagedWatch

_PER_PROCESS = (  # catalogue metric, ledger counter, scale
    (cat.SHARE_GPU_SECONDS, "gpu_ns", 1e-9),
    (cat.SHARE_THROTTLED_SECONDS, "throttled_ns", 1e-9),
    (cat.SHARE_LAUNCHES, "launches", 1),
    (cat.SHARE_BUSY_LAUNCHES, "busy_launches", 1),
    (cat.SHARE_HOOK_ERRORS, "hook_errors", 1),
    (cat.SHARE_FAILED_OPEN, "failed_open", 1),
    (cat.SHARE_WAITING_THREADS, "waiting", 1),
)

#: Every family collect() yields from the controller, then from the NVML watch and the cross-check
#: (those only where they run): describe() names them without reading live state, so a registry
#: refuses a second collector that would serve one of them.
_CONTROLLER = (*(m for m, _, _ in _PER_PROCESS), cat.SHARE_TARGET_RATIO, cat.SHARE_PROCESSES,
               cat.SHARE_SLICES, cat.SHARE_CHARGED_SECONDS, cat.SHARE_STATE_SECONDS, cat.SHARE_BUSY_RATIO,
               cat.SHARE_DUTY_RATIO, cat.SHARE_PROBES, cat.SHARE_BINDING, cat.SHARE_DRAIN_TIMEOUTS,
               cat.SHARE_YIELDS, cat.SHARE_LENDS, cat.SHARE_RECLAIMS, cat.SHARE_MEMORY_USED,
               cat.SHARE_MEMORY_CAP, cat.SHARE_MEMORY_REFUSED, cat.SHARE_JOINS, cat.SHARE_POLICY_RELOADS)
_WATCH = (cat.SHARE_UNMANAGED_PROCESSES, cat.SHARE_UNMANAGED_MEMORY)
_CHECK = (cat.SHARE_NVML_BUSY_SECONDS, cat.SHARE_UNDER_REPORTED)


class ShareCollector:
    """A prometheus_client collector over a running Controller."""

    def __init__(self, controller: Controller, watch: UnmanagedWatch | None = None,
                 check: ReportCheck | None = None) -> None:
        self.controller = controller
        self.watch = watch  # None where NVML cannot list the GPU's processes: no series then
        self.check = check

    def describe(self) -> Iterator[object]:
        metrics = (*_CONTROLLER, *(_WATCH if self.watch is not None else ()),
                   *(_CHECK if self.check is not None else ()))
        return (metric.family() for metric in metrics)

    def collect(self) -> Iterator[object]:
        snap = self.controller.snapshot()
        rows = [(tenant, str(pid), counters) for tenant, pid, counters in snap.processes]
        stats = snap.stats
        slices, charged, states = stats.slices, stats.charged_s, stats.state_s
        binding, timeouts, yields = stats.binding, stats.drain_timeouts, stats.yields
        lends, reclaims, probes, reloads = stats.lends, stats.reclaims, stats.probes, stats.policy_reloads
        ratios, duties, joins, memory = snap.busy_ratio, snap.duty, snap.joins, snap.memory
        for metric, key, scale in _PER_PROCESS:
            family = metric.family()
            for tenant, pid, counters in rows:
                family.add_metric([tenant, pid], counters[key] * scale)
            yield family
        target, procs = cat.SHARE_TARGET_RATIO.family(), cat.SHARE_PROCESSES.family()
        sl, ch = cat.SHARE_SLICES.family(), cat.SHARE_CHARGED_SECONDS.family()
        for t in snap.tenants:
            target.add_metric([t.name], t.share)
            procs.add_metric([t.name], sum(1 for tenant, _, _ in rows if tenant == t.name))
            sl.add_metric([t.name], slices.get(t.name, 0))
            ch.add_metric([t.name], charged.get(t.name, 0.0))
        yield target
        yield procs
        yield sl
        yield ch
        st = cat.SHARE_STATE_SECONDS.family()
        for (tenant, state), seconds in sorted(states.items()):
            st.add_metric([tenant, state], seconds)
        yield st
        br = cat.SHARE_BUSY_RATIO.family()
        for tenant, ratio in sorted(ratios.items()):
            br.add_metric([tenant], ratio)
        yield br
        du = cat.SHARE_DUTY_RATIO.family()
        for tenant, duty in sorted(duties.items()):
            du.add_metric([tenant], duty)
        yield du
        pr = cat.SHARE_PROBES.family()
        pr.add_metric([], probes)
        yield pr
        b = cat.SHARE_BINDING.family()
        b.add_metric([], 1.0 if binding else 0.0)
        yield b
        d = cat.SHARE_DRAIN_TIMEOUTS.family()
        d.add_metric([], timeouts)
        yield d
        turns = ((cat.SHARE_YIELDS, yields), (cat.SHARE_LENDS, lends), (cat.SHARE_RECLAIMS, reclaims))
        for metric, value in turns:
            family = metric.family()
            family.add_metric([], value)
            yield family
        used, cap, refused = (m.family() for m in (cat.SHARE_MEMORY_USED, cat.SHARE_MEMORY_CAP,
                                                   cat.SHARE_MEMORY_REFUSED))
        for tenant, held, refusals, cap_bytes in memory:
            used.add_metric([tenant], held)
            refused.add_metric([tenant], refusals)
            if cap_bytes:
                cap.add_metric([tenant], cap_bytes)
        yield used
        yield cap
        yield refused
        if self.watch is not None:
            unmanaged = dict(self.watch.unmanaged)
            count, held = cat.SHARE_UNMANAGED_PROCESSES.family(), cat.SHARE_UNMANAGED_MEMORY.family()
            count.add_metric([], len(unmanaged))
            held.add_metric([], sum(unmanaged.values()))
            yield count
            yield held
        if self.check is not None:
            busy, flagged = cat.SHARE_NVML_BUSY_SECONDS.family(), cat.SHARE_UNDER_REPORTED.family()
            for tenant in (t.name for t in snap.tenants):
                busy.add_metric([tenant], self.check.nvml_busy_s.get(tenant, 0.0))
                flagged.add_metric([tenant], 1.0 if self.check.flagged.get(tenant) else 0.0)
            yield busy
            yield flagged
        pr = cat.SHARE_POLICY_RELOADS.family()
        for result, count in reloads.items():
            pr.add_metric([result], count)
        yield pr
        j = cat.SHARE_JOINS.family()
        for result, count in joins.items():
            j.add_metric([result], count)
        yield j
