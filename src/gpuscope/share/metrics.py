"""``/metrics`` of the share controller: the tenants' counters, read from their ledger slots."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gpuscope.contract import catalogue as cat
from gpuscope.share.controller import Controller
from gpuscope.share.crosscheck import ReportCheck
from gpuscope.share.ledger import HELPER_WAKE_REASONS
from gpuscope.share.node import Node
from gpuscope.share.unmanaged import UnmanagedWatch

_PER_PROCESS = (  # catalogue metric, ledger counter, scale
    (cat.SHARE_GPU_SECONDS, "gpu_ns", 1e-9),
    (cat.SHARE_THROTTLED_SECONDS, "throttled_ns", 1e-9),
    (cat.SHARE_SYNC_WAIT_SECONDS, "sync_wait_ns", 1e-9),
    (cat.SHARE_LAUNCHES, "launches", 1),
    (cat.SHARE_BUSY_LAUNCHES, "busy_launches", 1),
    (cat.SHARE_HOOK_ERRORS, "hook_errors", 1),
    (cat.SHARE_HELPER_CPU_SECONDS, "helper_cpu_ns", 1e-9),
    (cat.SHARE_FAILED_OPEN, "failed_open", 1),
    (cat.SHARE_WAITING_THREADS, "waiting", 1),
)

#: Every family collect() yields from the controller, then from the NVML watch and the cross-check
#: (those only where they run): describe() names them without reading live state, so a registry
#: refuses a second collector that would serve one of them.
_CONTROLLER = (*(m for m, _, _ in _PER_PROCESS), cat.SHARE_HELPER_WAKEUPS, cat.SHARE_TARGET_RATIO,
               cat.SHARE_PROCESSES,
               cat.SHARE_SLICES, cat.SHARE_CHARGED_SECONDS, cat.SHARE_STATE_SECONDS, cat.SHARE_BUSY_RATIO,
               cat.SHARE_DUTY_RATIO, cat.SHARE_BESIDE_THROUGHPUT, cat.SHARE_STARVED, cat.SHARE_PROBES,
               cat.SHARE_BINDING, cat.SHARE_DRAIN_TIMEOUTS, cat.SHARE_YIELDS, cat.SHARE_LENDS,
               cat.SHARE_RECLAIMS, cat.SHARE_PRIORITY_HOLDS, cat.SHARE_PRIORITY_HOLD_SECONDS,
               cat.SHARE_MEMORY_USED, cat.SHARE_MEMORY_CAP, cat.SHARE_MEMORY_REFUSED,
               cat.SHARE_JOINS, cat.SHARE_POLICY_RELOADS)
_WATCH = (cat.SHARE_UNMANAGED_PROCESSES, cat.SHARE_UNMANAGED_MEMORY)
_CHECK = (cat.SHARE_NVML_BUSY_SECONDS, cat.SHARE_UNDER_REPORTED)


@dataclass(frozen=True)
class GpuWatch:
    """NVML's view of one GPU (``watch``: its processes that never joined; ``check``: what its tenants
    report against NVML): None where NVML cannot list its processes."""

    watch: UnmanagedWatch | None
    check: ReportCheck | None


class ShareCollector:
    """A prometheus_client collector over a running controller: a ``Node`` of GPUs, or one
    ``Controller`` (``watches``: NVML's view of each GPU, in the same order)."""

    def __init__(self, node: Node | Controller, watches: Sequence[GpuWatch] | UnmanagedWatch | None = None,
                 check: ReportCheck | None = None) -> None:
        self.controllers = node.controllers if isinstance(node, Node) else [node]
        self.node = node if isinstance(node, Node) else None
        if watches is None or isinstance(watches, UnmanagedWatch):  # one controller, as before nodes
            watches = [GpuWatch(watches, check if watches is not None else None)]
        self.watches = list(watches) + [GpuWatch(None, None)] * (len(self.controllers) - len(watches))

    def describe(self) -> Iterator[object]:
        watched = any(w.watch is not None for w in self.watches)
        checked = any(w.check is not None for w in self.watches)
        metrics = (*_CONTROLLER, *(_WATCH if watched else ()), *(_CHECK if checked else ()))
        return (metric.family() for metric in metrics)

    def collect(self) -> Iterator[object]:
        families = {m.name: m.family() for m in (*_CONTROLLER, *_WATCH, *_CHECK)}
        for controller, watch in zip(self.controllers, self.watches, strict=True):
            self._add(families, controller, watch)
        if self.node is not None:
            joins, reloads = self.node.joins, self.node.policy_reloads
        else:
            snap = self.controllers[0].snapshot()
            joins, reloads = snap.joins, snap.stats.policy_reloads
        for result, count in reloads.items():
            families[cat.SHARE_POLICY_RELOADS.name].add_metric([result], count)
        for result, count in joins.items():
            families[cat.SHARE_JOINS.name].add_metric([result], count)
        watched = any(w.watch is not None for w in self.watches)
        checked = any(w.check is not None for w in self.watches)
        for metric in (*_CONTROLLER, *(_WATCH if watched else ()), *(_CHECK if checked else ())):
            yield families[metric.name]

    @staticmethod
    def _add(families: dict[str, object], controller: Controller, watch: GpuWatch) -> None:
        """One GPU's series, each labelled with the GPU's index and UUID."""
        gpu = [controller.gpu.label, controller.gpu.uuid]

        def add(metric, labels: list[str], value: float) -> None:
            families[metric.name].add_metric([*labels, *gpu], value)

        snap = controller.snapshot()
        rows = [(tenant, str(pid), counters) for tenant, pid, counters in snap.processes]
        stats = snap.stats
        for metric, key, scale in _PER_PROCESS:
            for tenant, pid, counters in rows:
                add(metric, [tenant, pid], counters[key] * scale)
        for tenant, pid, counters in rows:
            for reason in HELPER_WAKE_REASONS:
                add(cat.SHARE_HELPER_WAKEUPS, [tenant, pid, reason], counters[f"helper_wakes_{reason}"])
        for t in snap.tenants:
            add(cat.SHARE_TARGET_RATIO, [t.name], t.share)
            add(cat.SHARE_PROCESSES, [t.name], sum(1 for tenant, _, _ in rows if tenant == t.name))
            add(cat.SHARE_SLICES, [t.name], stats.slices.get(t.name, 0))
            add(cat.SHARE_CHARGED_SECONDS, [t.name], stats.charged_s.get(t.name, 0.0))
        for (tenant, state), seconds in sorted(stats.state_s.items()):
            add(cat.SHARE_STATE_SECONDS, [tenant, state], seconds)
        for tenant, ratio in sorted(snap.busy_ratio.items()):
            add(cat.SHARE_BUSY_RATIO, [tenant], ratio)
        for tenant, duty in sorted(snap.duty.items()):
            add(cat.SHARE_DUTY_RATIO, [tenant], duty)
        for tenant, ratio in sorted(snap.beside_throughput.items()):
            add(cat.SHARE_BESIDE_THROUGHPUT, [tenant], ratio)
        for t in snap.tenants:
            add(cat.SHARE_STARVED, [t.name], stats.starved.get(t.name, 0))
        add(cat.SHARE_PROBES, [], stats.probes)
        add(cat.SHARE_BINDING, [], 1.0 if stats.binding else 0.0)
        add(cat.SHARE_DRAIN_TIMEOUTS, [], stats.drain_timeouts)
        add(cat.SHARE_YIELDS, [], stats.yields)
        add(cat.SHARE_LENDS, [], stats.lends)
        add(cat.SHARE_RECLAIMS, [], stats.reclaims)
        add(cat.SHARE_PRIORITY_HOLDS, [], stats.priority_holds)
        add(cat.SHARE_PRIORITY_HOLD_SECONDS, [], stats.priority_hold_s)
        for tenant, held, refusals, cap_bytes in snap.memory:
            add(cat.SHARE_MEMORY_USED, [tenant], held)
            add(cat.SHARE_MEMORY_REFUSED, [tenant], refusals)
            if cap_bytes:
                add(cat.SHARE_MEMORY_CAP, [tenant], cap_bytes)
        if watch.watch is not None:
            unmanaged = dict(watch.watch.unmanaged)
            add(cat.SHARE_UNMANAGED_PROCESSES, [], len(unmanaged))
            add(cat.SHARE_UNMANAGED_MEMORY, [], sum(unmanaged.values()))
        if watch.check is not None:
            for tenant in (t.name for t in snap.tenants):
                add(cat.SHARE_NVML_BUSY_SECONDS, [tenant], watch.check.nvml_busy_s.get(tenant, 0.0))
                add(cat.SHARE_UNDER_REPORTED, [tenant], 1.0 if watch.check.flagged.get(tenant) else 0.0)
