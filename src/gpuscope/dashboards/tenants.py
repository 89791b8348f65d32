"""Tenants and scheduling: GPU-time share against quota, queue wait, starvation (a vLLM model is a
tenant: its queue, its tokens; GPU-time shares are gpuscope serve's, and those of the processes that
`gpuscope share` holds to shares of one GPU, whose backlog is their threads held at the gate)."""

from gpuscope.contract import catalogue as m
from gpuscope.contract import names, uids
from gpuscope.dashboards import energy
from gpuscope.dashboards.common import (
    PromTarget,
    dashboard,
    heatmap,
    heatmap_expr,
    instance_var,
    quantile_expr,
    sel,
    sum_expr,
    table,
    tenant_var,
    timeseries,
)

T = "tenant"
GPU_RATE = sum_expr(names.TENANT_GPU_SECONDS_RATE, T, by=[T])
SHARE = f"{GPU_RATE} / ignoring(tenant) group_left sum({GPU_RATE})"
QUOTA = f"max by (tenant) ({sel(names.TENANT_SHARE_QUOTA, T)})"
#: 1 while a tenant has requests waiting but generated no token: starvation in the making.
STARVING = (f"(sum by (tenant) ({sel(names.QUEUE_DEPTH, T)}) > bool 0)"
            f" * on (tenant) ({sum_expr(names.GENERATION_TOKENS_RATE, T, by=[T])} == bool 0)")

dashboard = dashboard(
    uid=uids.TENANTS,
    title="gpuscope / Tenants and scheduling",
    description="Per-tenant GPU time measured with CUDA events against each tenant's configured share, "
                "queue wait, and starvation indicators; tenants of gpuscope serve, and processes held to "
                "GPU-time shares by gpuscope share (their backlog: threads held at the gate).",
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
                   PromTarget(quantile_expr(0.99, m.REQUEST_QUEUE, T, by=[T]), "{{tenant}} p99"),
                   PromTarget(quantile_expr(0.5, m.REQUEST_QUEUE, T, by=[T]), "{{tenant}} p50"),
                   unit="s", w=12),
        heatmap("Queue wait", heatmap_expr(m.REQUEST_QUEUE, T), w=12,
                description="Queued to first scheduled, every selected tenant."),
        timeseries("Waiting requests per tenant", PromTarget(sum_expr(names.QUEUE_DEPTH, T, by=[T]),
                                                             "{{tenant}}"), w=12),
        timeseries("Recorded GPU-time share (starvation window)",
                   PromTarget(sel(names.TENANT_GPU_SHARE, T), "{{instance}} {{tenant}}"),
                   unit="percentunit", w=12,
                   description="The share the starvation alert compares with each tenant's quota."),
        timeseries("Starvation indicator", PromTarget(STARVING, "{{tenant}}"), w=12,
                   description="1 while a tenant has requests waiting and generated no token over the "
                               "starvation window."),
        timeseries("Rejected and aborted requests per tenant",
                   PromTarget(sum_expr(names.REQUESTS_RATE, T, by=[T, "outcome"],
                                       extra='outcome=~"rejected|abort"'),
                              "{{tenant}} {{outcome}}"), unit="reqps", w=12),
        timeseries("Output tokens / s per tenant",
                   PromTarget(sum_expr(names.GENERATION_TOKENS_RATE, T, by=[T]), "{{tenant}}"), w=12),
        timeseries("TTFT p99 per tenant",
                   PromTarget(quantile_expr(0.99, m.REQUEST_TTFT, T, by=[T]), "{{tenant}}"),
                   unit="s", w=12),
        *energy.panels(),
    ],
)
