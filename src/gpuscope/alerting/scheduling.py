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
"""

from __future__ import annotations

from gpuscope.alerting.rules import Alert, Doc, Group, Record, duration, num, query_value
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Profile

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
    return [Group("gpuscope-scheduling", (share, *alerts))]
