"""Health of the parts that feed every other alert: scrapes, the exporter, the GPUs, the timer."""

from __future__ import annotations

from gpuscope.alerting import operator_labels
from gpuscope.alerting.rules import Alert, Doc, Group, Severity, query_value
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import duration, num, sel


def _throttle(p: Profile, name: str, cause: str, reasons: str) -> Alert:
    t, w = p.thresholds, p.windows
    window = duration(w.throttle)
    clock = sel(names.GPU_CLOCK_EVENT_RATIO, f'reason=~"{reasons}"')
    return Alert(
        name=name,
        expr=operator_labels.joined(f"max by (job, instance, gpu) ({clock}) > {num(t.throttle_ratio)}"),
        for_s=w.throttle_for, severity="warning", service=p.selectors.exporter_service,
        dashboard=uids.FLEET, dashboard_vars=("instance", "gpu"),
        summary=f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.instance }}}} is {cause} throttled",
        description=(f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.instance }}}}{operator_labels.WORKLOAD} "
                     f"ran with its clocks held back for {cause} reasons "
                     f"{{{{ $value | humanizePercentage }}}} of the "
                     f"last {window}."),
        doc=Doc(what=f"Clocks held back for {cause} reasons (clock event reasons matching `{reasons}`)",
                threshold=f"> {num(t.throttle_ratio * 100)}% of the time",
                window=f"{window}, for {duration(w.throttle_for)}",
                why="Brief throttling is normal under boost; half the time for many minutes means "
                    "every kernel runs slower."))


def _scrape_down(p: Profile, name: str, up: str, severity: Severity, service: str, title: str,
                 consequence: str, what: str, why: str) -> Alert:
    """``up == 0`` for a listed target of one role, with what its silence means."""
    down_for = duration(p.windows.scrape_down_for)
    return Alert(name=name, expr=f"{up} == 0", for_s=p.windows.scrape_down_for, severity=severity,
                 service=service, dashboard=uids.FLEET,
                 summary=f"{title} {{{{ $labels.instance }}}} is down",
                 description=(f"Prometheus could not scrape {{{{ $labels.instance }}}} "
                              f"(job {{{{ $labels.job }}}}) for {down_for}: {consequence}."),
                 doc=Doc(what=what, threshold="up == 0", window=f"for {down_for}", why=why))


def _targets_missing(p: Profile, name: str, role: str, service: str, what: str,
                     none_severity: Severity, desired: str) -> list[Alert]:
    """``up == 0`` covers only targets still listed: these cover the ones service discovery dropped.

    None at all (``absent``: it keeps firing however long ago they went), and fewer than
    ``target_missing`` ago (one of several left; resolves that long after, or when it is back). A
    drop is deliberate, and stays quiet, when kube-state-metrics' desired count (``desired``) fell
    with it (an HPA scale-down, a node removed); without kube-state-metrics, when every target that
    left answered its scrapes until it left (a pod stopped by a scale-down leaves discovery as it
    terminates; a lost one fails first). "None at all" waits until the rules have run for
    ``target_start_grace``, so a start, while targets come up, leaves no pending state; "fewer" needs
    a count from ``target_missing`` ago, which a fresh start does not have.
    """
    w = p.windows
    up, absent = names.TARGETS[role]
    ago, down_for = duration(w.target_missing), duration(w.scrape_down_for)
    # The rules have run for the grace: one of the two records existed that long ago (the up record
    # while a target is listed, the absent one while none is), so a fresh start has neither.
    before = f"offset {duration(w.target_start_grace)}"
    running = f"on (job) ({absent} {before} or count by (job) ({up} {before}))"
    now = query_value(f"count({up}{{job='%s'}})", ("job",), "humanize")
    gone = (f'{{{{ range $i, $s := printf "{up}{{job=\'%s\'}} offset {ago} unless on (instance) '
            f'{up}{{job=\'%s\'}}" $labels.job $labels.job | query | sortByLabel "instance" }}}}'
            f'{{{{ if $i }}}}, {{{{ end }}}}'
            f'{{{{ $s.Labels.instance }}}}{{{{ end }}}}')
    count = f"count by (job) ({up})"
    # One count per namespace of the named workload: several kube-state-metrics replicas (HA) expose
    # the same series, which a plain sum would count twice.
    wanted = f"on () group_left () sum(max by (namespace) ({desired}))"
    failed_first = f"count by (job) (min_over_time({up}[{ago}]) == 0 unless on (job, instance) {up})"
    common = {"name": name, "for_s": w.scrape_down_for, "service": service, "dashboard": uids.FLEET,
              "dashboard_vars": ()}
    return [
        Alert(**common, expr=f"{absent}\nand {running}", severity=none_severity, labels={"missing": "all"},
              summary=f"No {what} target is scraped ({{{{ $labels.job }}}})",
              description=(f"Prometheus has had no target of job {{{{ $labels.job }}}} for {down_for}: "
                           f"the {what} left service discovery or the scrape configuration, so none of "
                           f"its alerts can fire (up == 0 needs a listed target)."),
              doc=Doc(what=f"No {what} target at all", threshold="absent(up) for its job",
                      window=f"for {down_for}, once the rules have run for "
                             f"{duration(w.target_start_grace)}",
                      why="A target that service discovery drops has no up series, so the down alert "
                          "stays silent; absent() keeps firing however long ago it went.")),
        Alert(**common, severity="warning", labels={"missing": "some"},
              expr=(f"(\n  count by (job) ({up} offset {ago})\n  > on (job)\n  {count}\n"
                    f"  unless on (job)\n  {count} >= {wanted}\n)\n"
                    f"and on (job)\n(\n  {count} < {wanted}\n  or\n  {failed_first}\n)"),
              summary=f"Fewer {what} targets than {ago} ago ({{{{ $labels.job }}}})",
              description=(f"Job {{{{ $labels.job }}}} has {now} target(s); it had {{{{ $value }}}} {ago} "
                           f"ago. Gone from discovery: {gone}."),
              doc=Doc(what=f"Fewer {what} targets than before: some left service discovery, and not "
                           f"because fewer were wanted",
                      threshold=(f"count(up) < count(up offset {ago}), and below kube-state-metrics' "
                                 f"desired count (`{desired}`), or, without it, a target that left had "
                                 f"failed scrapes first"),
                      window=f"for {down_for}; resolves {ago} after it left",
                      why="One of several targets dropped by discovery raises no up == 0; counting "
                          "targets catches it and leaves a restart under a new instance name alone. "
                          "A scale-down lowers the desired count with the targets (or its pods answer "
                          "until they go), so it stays quiet.")),
    ]


def groups(p: Profile) -> list[Group]:
    s, t, w = p.selectors, p.thresholds, p.windows
    srv, exp = s.server_service, s.exporter_service
    xids = "|".join(str(x) for x in t.xid_critical)
    xid_w = duration(w.xid)
    drop_w = duration(w.timer_drop)
    dropped, timed = names.TIMER_DROPPED_RATE, names.TIMER_TIMED_RATE
    gpu_vars = ("instance", "gpu")
    gpus, gpus_w = names.EXPORTER_GPUS, duration(w.gpus_missing)
    gpus_max = query_value(f"max_over_time({gpus}{{job='%s',instance='%s'}}[{gpus_w}])",
                           ("job", "instance"), "humanize")
    init_errors = f"{names.EXPORTER_INIT_ERRORS}{{job='%s',instance='%s'}}"
    nvml_init = (f'{{{{ with printf "{init_errors}" $labels.job $labels.instance | query }}}}'
                 f'{{{{ . | first | value | humanize }}}}{{{{ else }}}}0{{{{ end }}}}')
    alerts = [
        _scrape_down(p, "GPUServerDown", names.SERVER_UP, "critical", srv, "Inference server",
                     "the server is down or unreachable", "Server not scraped",
                     "Without the server's metrics no other server alert can fire."),
        _scrape_down(p, "GPUExporterDown", names.GPU_EXPORTER_UP, "warning", exp, "GPU exporter",
                     "GPU health on that host is unknown", "Exporter not scraped",
                     "The GPUs keep serving; only their visibility is lost, so a warning."),
        *_targets_missing(p, "GPUServerTargetMissing", "server", srv, "inference server", "critical",
                          s.server_desired),
        *_targets_missing(p, "GPUExporterTargetMissing", "gpu", exp, "GPU exporter", "warning",
                          s.exporter_desired),
        Alert(name="GPUExporterGPUsMissing",
              expr=(f"{gpus}\n< on (job, instance)\nmax_over_time({gpus}[{gpus_w}])"),
              for_s=w.scrape_down_for, severity="warning", service=exp, dashboard=uids.FLEET,
              summary="The exporter on {{ $labels.instance }} sees fewer GPUs than it did",
              description=(f"The exporter on {{{{ $labels.instance }}}} sees {{{{ $value }}}} GPU(s); it "
                           f"saw {gpus_max} within the last {gpus_w}. NVML initialisation failures since "
                           f"it started: {nvml_init}. GPUs it no longer sees have no gpu_up, so GPULost "
                           f"cannot fire for them."),
              doc=Doc(what="The exporter sees fewer GPUs than it did (NVML gone after a restart, a GPU "
                           "missing from enumeration)",
                      threshold=f"exporter_gpus < its maximum over {gpus_w}",
                      window=f"{gpus_w}, for {duration(w.scrape_down_for)}",
                      why="An exporter that restarts without NVML still answers scrapes and /healthz "
                          "with 0 GPUs: no GPU alert can fire. A host that never had GPUs stays silent.")),
        Alert(name="GPUExporterStale",
              expr=f"{names.EXPORTER_STALENESS} > {num(t.exporter_stale_s)}",
              for_s=w.exporter_stale_for, severity="warning", service=exp, dashboard=uids.FLEET,
              summary="GPU exporter {{ $labels.instance }} serves stale {{ $labels.collector }} values",
              description=("The {{ $labels.collector }} collector of {{ $labels.instance }} serves values "
                           "{{ $value | humanizeDuration }} old: its NVML sampling is stuck or failing."),
              doc=Doc(what="Cached NVML values not refreshed", threshold=f"> {num(t.exporter_stale_s)}s old",
                      window=f"for {duration(w.exporter_stale_for)}",
                      why="Scrapes never wait on NVML, so a hung NVML call shows up as age, not as a "
                          "failed scrape.")),
        Alert(name="GPULost", expr=operator_labels.joined(f"{names.EXPORTER_GPU_UP} == 0"),
              for_s=w.gpu_lost_for,
              severity="critical", service=exp, dashboard=uids.FLEET, dashboard_vars=gpu_vars,
              summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} stopped answering",
              description=(f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.instance }}}}"
                           f"{operator_labels.WORKLOAD} has not answered NVML for {duration(w.gpu_lost_for)} "
                           f"(lost from the bus or failing)."),
              doc=Doc(what="A GPU does not answer NVML", threshold="gpu_up == 0",
                      window=f"for {duration(w.gpu_lost_for)}",
                      why="Work on that GPU has stopped; usually needs a reset or a node drain.")),
        Alert(name="GPUFellOffBus",
              expr=f"{names.EXPORTER_GPUS_LOST} > 0", for_s=0,
              severity="critical", service=exp, dashboard=uids.FLEET,
              summary="A GPU fell off the bus on {{ $labels.instance }}",
              description=(f"NVML reported {{{{ $value | humanize }}}} GPU(s) lost from the bus on "
                           f"{{{{ $labels.instance }}}} in the last {xid_w}."),
              doc=Doc(what="NVML reported GPU_IS_LOST", threshold="any", window=xid_w,
                      why="Fires even when the GPU is gone from the exporter's list (no gpu_up left).")),
        Alert(name="GPUXidCritical",
              expr=operator_labels.joined(sel(names.GPU_XID_RECENT, f'xid=~"{xids}"')),
              for_s=0, severity="critical", service=exp, dashboard=uids.FLEET, dashboard_vars=gpu_vars,
              summary=("GPU {{ $labels.gpu }} on {{ $labels.instance }} reported critical XID "
                       "{{ $labels.xid }}"),
              description=(f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.instance }}}}"
                           f"{operator_labels.WORKLOAD} reported XID {{{{ $labels.xid }}}} in the last "
                           f"{xid_w}; this code means a hardware, memory or driver fault, not an "
                           f"application bug."),
              doc=Doc(what="An XID error with a hardware/driver code", threshold=f"XID in {xids}",
                      window=f"{xid_w} after the error",
                      why="Recorded per code by the GPU source (gpuscope exporter: the error counter or "
                          "its last-timestamp gauge, which also catches a series' first error; "
                          "dcgm-exporter: a change of the GPU's last XID code, from its last-XID gauge "
                          "or, since 3.3.6, its per-code series).")),
        _throttle(p, "GPUThermalThrottling", "thermal", t.throttle_thermal_reasons),
        _throttle(p, "GPUPowerThrottling", "power", t.throttle_power_reasons),
        Alert(name="GPUTimerDroppingSamples",
              expr=(f"sum by (job, instance, reason) ({dropped})\n/ on (job, instance) group_left ()\n"
                    f"(\n  (sum by (job, instance) ({timed}) or sum by (job, instance) ({dropped}) * 0)\n"
                    f"  + sum by (job, instance) ({dropped})\n)\n> {num(t.timer_drop_ratio)}"),
              for_s=w.timer_drop_for, severity="warning", service=srv, dashboard=uids.KERNELS,
              summary="The kernel timer on {{ $labels.instance }} drops samples ({{ $labels.reason }})",
              description=(f"{{{{ $value | humanizePercentage }}}} of sampled regions on "
                           f"{{{{ $labels.instance }}}} lost their timing over {drop_w} (reason "
                           f"{{{{ $labels.reason }}}}): kernel-time histograms undercount."),
              doc=Doc(what="Sampled regions whose timing was lost",
                      threshold=f"> {num(t.timer_drop_ratio * 100)}%",
                      window=f"{drop_w}, for {duration(w.timer_drop_for)}",
                      why="The hot path drops rather than blocks; sustained drops bias the kernel "
                          "latency alerts, so they must be visible.")),
    ]
    return [Group("gpuscope-health", tuple(alerts))]
