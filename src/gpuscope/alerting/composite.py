"""GPUServiceDegraded: two or more of the three degradation dimensions on one device of a server instance.

Each dimension is its component alerts' condition (same functions), recorded twice: per instance as
0 or 1 (label ``dimension``, for dashboards), and per device as 1 while it holds. All three are read
from the server's own metrics (kernel GPU time, the server's device memory, its tenant queues), so
they join on the server's ``job``, ``instance`` and ``device`` without mapping server devices to
exporter GPUs.

Two decisions, each tested in ``tests/alerts/cases/composite.test.yml``:

- **Same device.** A latency spike on one GPU and a leak on another GPU of the same instance are two
  problems (two tickets), not one degradation: the composite says "these symptoms share a cause",
  and a sick GPU, the commonest shared cause, is one device. Starvation has no device (it is the
  instance's scheduler), so it pairs with a spike or a leak on any device of the instance.
- **Held as long as a component must hold.** The composite's ``for`` is the longest ``for`` of its
  components. A traffic peak lifts kernel time and memory together for minutes; two brief symptoms
  of one peak are not stronger evidence than one, so a critical page may not rest on less
  persistence than the tickets it replaces. It fires at the evaluation where its second dimension
  has held that long, with that dimension's own alert, which Alertmanager's ``group_wait`` (at least
  two evaluation intervals) lets it inhibit before its first notification; the first dimension's
  ticket may already be out, sent while it was a single problem.
"""

from __future__ import annotations

from gpuscope.alerting import latency, memory, scheduling
from gpuscope.alerting.rules import Alert, Doc, Group, Record
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import duration

COMPONENTS = {  # dimension → the alerts that are its symptoms (inhibited by the composite)
    "latency_spike": ("GPUKernelLatencySpike", "GPUStepLatencySpike"),
    "memory_leak": ("GPUMemoryLeak", "GPUMemoryRunningOut", "GPUKVCacheExhausted"),
    "starvation": ("GPUTenantStarved", "GPUTenantUnderServed"),
}
COMPOSITE = "GPUServiceDegraded"
MIN_DIMENSIONS = 2


def conditions(p: Profile) -> dict[str, str]:
    """Each dimension as its component alerts' condition (the OR of them)."""
    return {"latency_spike": latency.latency_spike_condition(p),
            "memory_leak": memory.leak_condition(p),
            "starvation": scheduling.starvation_condition(p)}


def _indent(expr: str) -> str:
    return "  " + expr.replace("\n", "\n  ")


def component_alerts(p: Profile) -> list[Alert]:
    wanted = {name for alerts in COMPONENTS.values() for name in alerts}
    return [a for module in (latency, memory, scheduling) for g in module.groups(p)
            for a in g.alerts() if a.name in wanted]


def groups(p: Profile) -> list[Group]:
    components = component_alerts(p)
    dimensions = conditions(p)
    records = [
        Record(names.DEGRADATION,
               f"group by (job, instance) (\n{_indent(cond)}\n)\nor on (job, instance)\n"
               f"0 * {names.SERVER_UP}",
               {"dimension": dim})
        for dim, cond in dimensions.items()
    ]
    records += [
        Record(names.DEGRADATION_DEVICE,
               f"group by (job, instance, device) (\n{_indent(dimensions[dim])}\n)", {"dimension": dim})
        for dim in ("latency_spike", "memory_leak")
    ]
    records.append(Record(
        names.DEGRADATION_DEVICE,
        f"group by (job, instance) (\n{_indent(dimensions['starvation'])}\n)\n"
        f"* on (job, instance) group_right ()\ngroup by (job, instance, device) ({names.SERVER_DEVICE})",
        {"dimension": "starvation"}))
    on_device = f"sum by (job, instance, device) ({names.DEGRADATION_DEVICE}{{job='%s',instance='%s'}})"
    query = (f"group by (dimension) ({names.DEGRADATION_DEVICE}{{job='%s',instance='%s'}} "
             f"and on (job, instance, device) {on_device} >= {MIN_DIMENSIONS})")
    args = " ".join(["$labels.job $labels.instance"] * 2)
    dims = (f'{{{{ range $i, $d := printf "{query}" {args} | query | sortByLabel "dimension" }}}}'
            f'{{{{ if $i }}}}, {{{{ end }}}}{{{{ $d.Labels.dimension }}}}{{{{ end }}}}')
    for_s = max(a.for_s for a in components)
    composite = Alert(
        name=COMPOSITE,
        expr=(f"max by (job, instance) (\n  sum by (job, instance, device) ({names.DEGRADATION_DEVICE})\n)"
              f" >= {MIN_DIMENSIONS}"),
        for_s=for_s, severity="critical", service=p.selectors.server_service,
        # Its dimensions are its components' conditions: two at once need the slower one's evidence.
        evidence_s=max(a.evidence_s for a in components),
        dashboard=uids.FLEET,
        summary=f"{{{{ $labels.instance }}}} is degraded: {dims}",
        description=(f"{{{{ $value }}}} of {len(COMPONENTS)} degradation dimensions hold at once on one "
                     f"device of {{{{ $labels.instance }}}}: {dims}. Their component alerts on this "
                     f"instance are inhibited; start with the runbook, then each dimension's own section."),
        annotations={"dimensions": dims},
        doc=Doc(what="Two or more of latency spike, memory leak and starvation on one device of a server "
                     "instance (starvation, which has no device, pairs with any device)",
                threshold=f"≥ {MIN_DIMENSIONS} of {len(COMPONENTS)} dimensions on one device",
                window=f"for {duration(for_s)}, the longest `for` of its components (each dimension "
                       f"as its alerts' condition)",
                why="Several symptoms at once usually share a cause (a sick GPU, a runaway tenant); one "
                    "critical alert with the dimensions named replaces several warnings. Brief symptoms "
                    "of one traffic peak are not that: each must last as long as its own alert needs."),
    )
    return [Group("gpuscope-composite", (*records, composite))]
