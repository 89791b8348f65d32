"""Tenants and scheduling: GPU-time share against quota, queue wait, starvation."""

from gpuscope import catalogue as m
from gpuscope.alerting import names
from gpuscope.dashboards import uids
from gpuscope.dashboards.common import (
    PromTarget,
    dashboard,
    heatmap,
    heatmap_expr,
    instance_var,
    quantile_expr,
    rate_expr,
    sel,
    table,
    tenant_var,
    timeseries,
)

GPU_RATE = rate_expr(m.TENANT_GPU_SECONDS, by=["tenant"])
SHARE = f"{GPU_RATE} / ignoring(tenant) group_left sum({GPU_RATE})"
QUOTA = f"max by (tenant) ({sel(m.TENANT_SHARE_QUOTA)})"
#: 1 while a tenant has requests waiting but got no GPU time in the interval: starvation in the making.
STARVING = (f"(sum by (tenant) ({sel(m.QUEUE_DEPTH)}) > bool 0)"
            f" * on (tenant) ({GPU_RATE} == bool 0)")

dashboard = dashboard(
    uid=uids.TENANTS,
    title="gpuscope / Tenants and scheduling",
    description="Per-tenant GPU time measured with CUDA events against each tenant's configured share, "
                "queue wait, and starvation indicators.",
    tags=["server", "tenants"],
    variables=[instance_var(), tenant_var()],
    panels=[
        timeseries("GPU-time share per tenant", PromTarget(SHARE, "{{tenant}} share"),
                   PromTarget(QUOTA, "{{tenant}} quota"), unit="percentunit", w=16,
                   description="Measured share of GPU time (solid) against the configured quota (quota is 0 "
                               "in FCFS mode)."),
        table("Share against quota",
              PromTarget(SHARE, instant=True, format="table"),
              PromTarget(QUOTA, instant=True, format="table"), w=8,
              description="Value #A: measured share; Value #B: quota."),
        timeseries("GPU seconds per second per tenant", PromTarget(GPU_RATE, "{{tenant}}"), unit="s",
                   stack=True, w=12),
        timeseries("Queue wait p99 per tenant",
                   PromTarget(quantile_expr(0.99, m.REQUEST_QUEUE, by=["tenant"]), "{{tenant}} p99",
                              exemplar=True),
                   PromTarget(quantile_expr(0.5, m.REQUEST_QUEUE, by=["tenant"]), "{{tenant}} p50",
                              exemplar=True), unit="s", w=12),
        heatmap("Queue wait", heatmap_expr(m.REQUEST_QUEUE), w=12,
                description="Queued to first scheduled, every selected tenant."),
        timeseries("Waiting requests per tenant", PromTarget(f"sum by (tenant) ({sel(m.QUEUE_DEPTH)})",
                                                             "{{tenant}}"), w=12),
        timeseries("Recorded GPU-time share (starvation window)",
                   PromTarget(f'{names.TENANT_GPU_SHARE}{{instance=~"$instance",tenant=~"$tenant"}}',
                              "{{instance}} {{tenant}}"), unit="percentunit", w=12,
                   description="The share the starvation alert compares with each tenant's quota."),
        timeseries("Starvation indicator", PromTarget(STARVING, "{{tenant}}"), w=12,
                   description="1 while a tenant has requests waiting and received no GPU time in the "
                               "interval."),
        timeseries("Rejected and aborted requests per tenant",
                   PromTarget(rate_expr(m.REQUESTS, by=["tenant", "outcome"],
                                        extra='outcome=~"rejected|abort"'),
                              "{{tenant}} {{outcome}}"), unit="reqps", w=12),
        timeseries("Output tokens / s per tenant",
                   PromTarget(rate_expr(m.GENERATION_TOKENS, by=["tenant"]), "{{tenant}}"), w=12),
        timeseries("TTFT p99 per tenant",
                   PromTarget(quantile_expr(0.99, m.REQUEST_TTFT, by=["tenant"]), "{{tenant}}",
                              exemplar=True),
                   unit="s", w=12),
    ],
)
