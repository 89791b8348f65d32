"""Scheduling starvation: a tenant with queued work that gets no service, or far less than its share.

Starvation is judged per queue: per tenant, and per data-parallel engine where the source has
engines (vLLM's ``engine`` label, kept by its normalisation layer on waiting requests and generated
tokens): each engine schedules its own requests, so one that stalls while another serves is
starving its queue, which a sum over engines would hide. Sources without engines match on an empty
``engine``.

"Backlog" is ``min_over_time(queue depth)`` > 0: the tenant's queue never emptied during the window,
so a tenant that is idle by choice (empty queue) can never match. Progress is generated tokens,
service is the tenant's share of GPU time against its configured quota (0 in FCFS mode, where the
under-served test cannot fire). Queue-wait growth is alerted too, but is not a composite dimension:
every slowdown makes queues wait longer, so it would count a latency problem twice.

``gpuscope share`` holds processes to GPU-time shares on what they report, so two flags of its
controller are alerted too: processes on the GPU that never joined it (they run outside every share
and memory cap), and a tenant whose processes NVML sees busy for more than they were charged (one may
under-report its GPU time). Both already hold over several samples in the controller; the alerts'
``share_flag_for`` only rides out one flip.
"""

from __future__ import annotations

from gpuscope.alerting.rules import Alert, Doc, Group, Record, query_value
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Profile
from gpuscope.share import crosscheck
from gpuscope.util.promql import duration, num

LABELS = ("job", "instance", "tenant")
ON = "on (job, instance, tenant)"
#: A starved queue: one tenant's on one engine (``engine`` is empty where a source has none).
QUEUE = "job, instance, tenant, engine"
#: " (engine N)" where the alert carries an engine.
ENGINE = "{{ if $labels.engine }} (engine {{ $labels.engine }}){{ end }}"


BACKLOG = f"{names.TENANT_BACKLOG} > 0"


def starved_condition(p: Profile) -> str:
    return (f"{BACKLOG}\nunless on ({QUEUE})\n"
            f"sum by ({QUEUE}) ({names.GENERATION_TOKENS_RATE}) > 0")


def underserved_condition(p: Profile) -> str:
    share, quota = names.TENANT_GPU_SHARE, names.TENANT_SHARE_QUOTA
    fraction = num(p.thresholds.underserved_share_fraction)
    return (f"{share} > 0\nand {ON}\n{share} < {ON} ({fraction} * {quota})\nand {ON}\n{BACKLOG}")


def starvation_condition(p: Profile) -> str:
    """The starvation dimension of the composite: a tenant starved or under-served."""
    return f"({starved_condition(p)})\nor\n({underserved_condition(p)})"


def groups(p: Profile) -> list[Group]:
    t, w = p.thresholds, p.windows
    window = duration(w.starvation)
    spent = names.TENANT_GPU_SECONDS_RATE
    match = "job='%s',instance='%s',tenant='%s'"
    depth = query_value(f"{names.TENANT_BACKLOG}{{{match}}}", LABELS, "humanize")
    quota = query_value(f"{names.TENANT_SHARE_QUOTA}{{{match}}}", LABELS, "humanizePercentage")
    q_p99 = query_value(f"{names.QUEUE_P99}{{{match}}}", LABELS, "humanizeDuration")
    q_base = query_value(f"{names.QUEUE_P99_BASELINE}{{{match}}}", LABELS, "humanizeDuration")
    common = {"service": p.selectors.server_service, "dashboard": uids.TENANTS,
              "dashboard_vars": ("instance", "tenant")}
    share = Record(
        names.TENANT_GPU_SHARE,
        f"sum by (job, instance, tenant) ({spent})\n/ on (job, instance) group_left\n"
        f"sum by (job, instance) ({spent})")
    alerts = [
        Alert(name="GPUTenantStarved", expr=starved_condition(p), for_s=w.starvation_for,
              evidence_s=w.starvation,
              severity="warning", **common,
              summary="Tenant {{ $labels.tenant }} gets no service on {{ $labels.instance }}" + ENGINE,
              description=(f"Tenant {{{{ $labels.tenant }}}} on {{{{ $labels.instance }}}}{ENGINE} has had "
                           f"at least {{{{ $value | humanize }}}} requests queued for {window} and no token "
                           f"generated in that time."),
              doc=Doc(what="A tenant with queued work makes no progress (composite dimension: starvation)",
                      threshold="queue never empty and zero tokens generated",
                      window=f"{window}, for {duration(w.starvation_for)}",
                      why="Queued work and no tokens is starvation whatever the load; an idle tenant "
                          "has an empty queue and cannot match. Judged per data-parallel engine where "
                          "the source has engines (vLLM), so a stalled engine is not hidden by one "
                          "that serves.")),
        Alert(name="GPUTenantUnderServed", expr=underserved_condition(p), for_s=w.starvation_for,
              evidence_s=w.starvation,
              severity="warning", **common,
              summary=("Tenant {{ $labels.tenant }} gets far less than its GPU share on "
                       "{{ $labels.instance }}"),
              description=(f"Tenant {{{{ $labels.tenant }}}} on {{{{ $labels.instance }}}} got "
                           f"{{{{ $value | humanizePercentage }}}} of GPU time over {window} against a "
                           f"quota of {quota}, with at least {depth} requests queued throughout."),
              doc=Doc(what="A tenant with backlog gets far less GPU time than its quota (composite "
                           "dimension: starvation)",
                      threshold=f"share < {num(t.underserved_share_fraction)} × quota (quota > 0), "
                                f"queue never empty",
                      window=f"{window}, for {duration(w.starvation_for)}",
                      why="A fair-share scheduler owes a backlogged tenant its quota; half of it "
                          "leaves room for bursts and measurement noise.")),
        Alert(name="GPUTenantQueueWaitHigh",
              expr=(f"{names.QUEUE_P99} / {names.QUEUE_P99_BASELINE} > {num(t.latency_spike_ratio)}\n"
                    f"and {names.QUEUE_P99} > {num(t.queue_wait_min_p99_s)}\n"
                    f"and {names.QUEUE_SAMPLES_RATE} >= {num(t.request_min_requests_per_s)}"),
              for_s=w.latency_for, severity="warning", **common,
              summary="Queue wait of tenant {{ $labels.tenant }} grew on {{ $labels.instance }}",
              description=(f"p99 queue wait of tenant {{{{ $labels.tenant }}}} on {{{{ $labels.instance }}}} "
                           f"is {q_p99} over {duration(w.latency)}, {{{{ $value | humanize }}}}× its "
                           f"baseline of {q_base}."),
              doc=Doc(what="p99 queue wait of a tenant far above its usual p99",
                      threshold=f"p99 ≥ {num(t.latency_spike_ratio)}× baseline and > "
                                f"{num(t.queue_wait_min_p99_s)}s, ≥ {num(t.request_min_requests_per_s)} "
                                f"requests/s",
                      window=f"p99 over {duration(w.latency)}, for {duration(w.latency_for)}",
                      why="Early sign of overload or unfair scheduling; not a composite dimension "
                          "because any slowdown lengthens queues.")),
    ]
    return [Group("gpuscope-scheduling", (share, *alerts, *share_flag_alerts(p)))]


def share_flag_alerts(p: Profile) -> list[Alert]:
    """The share controller's flags: processes outside it, a tenant under-reporting its GPU time."""
    w = p.windows
    match = "job='%s',instance='%s',tenant='%s'"
    held = query_value(f"{names.UNMANAGED_MEMORY}{{job='%s',instance='%s'}}", ("job", "instance"),
                       "humanize1024")
    nvml = query_value(f"{names.TENANT_NVML_BUSY_RATE}{{{match}}}", LABELS, "humanizePercentage")
    charged = query_value(f"{names.TENANT_GPU_SECONDS_RATE}{{{match}}}", LABELS, "humanizePercentage")
    check, tolerance = duration(int(crosscheck.WINDOW_S)), num(crosscheck.TOLERANCE * 100)
    common = {"service": p.selectors.server_service, "dashboard": uids.TENANTS, "severity": "warning",
              "for_s": w.share_flag_for}
    return [
        Alert(name="GPUShareUnmanagedProcesses", expr=f"{names.UNMANAGED_PROCESSES} > 0", **common,
              dashboard_vars=("instance",),
              summary="Processes run outside the share controller on {{ $labels.instance }}",
              description=(f"{{{{ $value }}}} process(es) on the GPU of the share controller "
                           f"{{{{ $labels.instance }}}} never joined it and hold {held}B of device memory: "
                           f"they run outside every GPU-time share and memory cap. The controller's log "
                           f"names each once, with its pid and command line."),
              doc=Doc(what="Processes on a gpuscope share GPU that never joined the controller: outside "
                           "every share and memory cap",
                      threshold="≥ 1 such process (seen by NVML in two samples in a row)",
                      window=f"for {duration(w.share_flag_for)}",
                      why="Their GPU time and memory are accounted to no tenant, so no tenant's share or "
                          "cap holds while they run; the short wait leaves out a check that exits "
                          "within seconds.")),
        Alert(name="GPUTenantUnderReported", expr=f"{names.TENANT_UNDER_REPORTED} == 1", **common,
              dashboard_vars=("instance", "tenant"),
              summary="Tenant {{ $labels.tenant }} may under-report its GPU time on {{ $labels.instance }}",
              description=(f"NVML saw the processes of tenant {{{{ $labels.tenant }}}} on "
                           f"{{{{ $labels.instance }}}} busy {nvml} of the GPU's time over the last "
                           f"{duration(w.starvation)}, against {charged} charged to it; the controller "
                           f"flags a gap of more than {tolerance}% of the wall time over {check}. One of "
                           f"its processes may under-report its GPU time, and so get more than its share."),
              doc=Doc(what="NVML sees a gpuscope share tenant's processes busy for more GPU time than "
                           "they were charged (the controller's flag)",
                      threshold=f"NVML busy time > charged time + {tolerance}% of the wall time",
                      window=f"the controller's {check}, for {duration(w.share_flag_for)}",
                      why="Shares are enforced on what the processes report, which a process can "
                          "rewrite; NVML's per-process utilization is coarse, so only a gap that large "
                          "over minutes counts. Reading lower than the charge is not flagged.")),
    ]
