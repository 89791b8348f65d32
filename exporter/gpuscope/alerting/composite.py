"""GPUServiceDegraded: two or more of the three degradation dimensions on one server instance at once.

Each dimension is a recording rule giving 0 or 1 per server instance (label ``dimension``), so the
composite is a plain sum and dashboards can show which dimensions hold. All three are read from the
server's own metrics (kernel GPU time, the server's device memory, its tenant queues), so they join
on the server's ``job`` and ``instance`` without mapping server devices to exporter GPUs; ``device``
is dropped because starvation (a queue) has none. The dimension conditions are the component
alerts' own expressions (same functions), without their ``for``: the composite has its own, shorter
``for`` because two dimensions at once are stronger evidence, which also lets it reach Alertmanager
before its components, whom it inhibits.
"""

from __future__ import annotations

from gpuscope.alerting import latency, memory, names, scheduling
from gpuscope.alerting.config import Profile
from gpuscope.alerting.rules import Alert, Doc, Group, Record, duration, sel

COMPONENTS = {  # dimension → the alerts that are its symptoms (inhibited by the composite)
    "latency_spike": ("GPUKernelLatencySpike",),
    "memory_leak": ("GPUMemoryLeak",),
    "starvation": ("GPUTenantStarved", "GPUTenantUnderServed"),
}
COMPOSITE = "GPUServiceDegraded"
MIN_DIMENSIONS = 2


def _conditions(p: Profile) -> dict[str, str]:
    return {"latency_spike": latency.kernel_spike_condition(p),
            "memory_leak": memory.leak_condition(p),
            "starvation": scheduling.starvation_condition(p)}


def groups(p: Profile) -> list[Group]:
    up = sel("up", p.selectors.server)
    names_of_components = {name for alerts in COMPONENTS.values() for name in alerts}
    component_alerts = [a for module in (latency, memory, scheduling) for g in module.groups(p)
                        for a in g.alerts() if a.name in names_of_components]
    records = [
        Record(names.DEGRADATION,
               f"group by (job, instance) (\n  {cond.replace(chr(10), chr(10) + '  ')}\n)\n"
               f"or on (job, instance)\n0 * {up}",
               {"dimension": dim})
        for dim, cond in _conditions(p).items()
    ]
    dims = (f'{{{{ range $i, $d := printf "{names.DEGRADATION}{{job=\'%s\',instance=\'%s\'}} == 1" '
            f'$labels.job $labels.instance | query | sortByLabel "dimension" }}}}'
            f'{{{{ if $i }}}}, {{{{ end }}}}{{{{ $d.Labels.dimension }}}}{{{{ end }}}}')
    composite = Alert(
        name=COMPOSITE, expr=f"sum by (job, instance) ({names.DEGRADATION}) >= {MIN_DIMENSIONS}",
        for_s=p.windows.composite_for, severity="critical", service=p.selectors.server_service,
        # Its dimensions are its components' conditions: two at once need the slower one's evidence.
        evidence_s=max(a.evidence_s for a in component_alerts),
        dashboard="gpuscope-fleet",
        summary=f"{{{{ $labels.instance }}}} is degraded: {dims}",
        description=(f"{{{{ $value }}}} of {len(COMPONENTS)} degradation dimensions hold at once on "
                     f"{{{{ $labels.instance }}}}: {dims}. Their component alerts on this instance are "
                     f"inhibited; start with the runbook, then each dimension's own section."),
        annotations={"dimensions": dims},
        doc=Doc(what="Two or more of latency spike, memory leak and starvation on one server instance",
                threshold=f"≥ {MIN_DIMENSIONS} of {len(COMPONENTS)} dimensions",
                window=f"for {duration(p.windows.composite_for)} (each dimension as its alert's condition)",
                why="Several symptoms at once usually share a cause (a sick GPU, a runaway tenant); one "
                    "critical alert with the dimensions named replaces several warnings."),
    )
    return [Group("gpuscope-composite", (*records, composite))]
