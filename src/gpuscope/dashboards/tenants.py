"""Tenants and scheduling: GPU-time share against quota, queue wait, starvation (a vLLM model is a
tenant: its queue, its tokens; GPU-time shares are gpuscope serve's, and those of the processes that
`gpuscope share` holds to shares of one GPU, whose backlog is their threads held at the gate). Beside
time, the memory of `gpuscope share`'s tenants against their caps, the allocations refused at a cap,
the processes on its GPU that never joined it, and each tenant's GPU time as NVML sees it."""

from gpuscope.contract import catalogue as m
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Thresholds
from gpuscope.dashboards import energy
from gpuscope.dashboards.common import (
    PromTarget,
    dashboard,
    filtered,
    heatmap,
    heatmap_expr,
    instance_var,
    quantile_expr,
    sum_expr,
    table,
    tenant_var,
    timeseries,
)

T = "tenant"
GPU_RATE = sum_expr(names.TENANT_GPU_SECONDS_RATE, T, by=[T])
SHARE = f"{GPU_RATE} / ignoring(tenant) group_left sum({GPU_RATE})"
QUOTA = f"max by (tenant) ({filtered(names.TENANT_SHARE_QUOTA, T)})"
#: 1 while a tenant has requests waiting but generated no token: starvation in the making.
STARVING = (f"(sum by (tenant) ({filtered(names.QUEUE_DEPTH, T)}) > bool 0)"
            f" * on (tenant) ({sum_expr(names.GENERATION_TOKENS_RATE, T, by=[T])} == bool 0)")

MEMORY_USED = f"sum by (tenant) ({filtered(names.TENANT_MEMORY_USED, T)})"
MEMORY_CAP = f"max by (tenant) ({filtered(names.TENANT_MEMORY_CAP, T)})"
NEAR_CAP = Thresholds().bottleneck_memory_ratio

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
        timeseries("Device memory per tenant against its cap", PromTarget(MEMORY_USED, "{{tenant}} used"),
                   PromTarget(MEMORY_CAP, "{{tenant}} cap"), unit="bytes", w=12,
                   description="gpuscope share: the device memory all of a tenant's processes hold "
                               "together, and its cap (none for a tenant without one). An allocation "
                               "past the cap is refused with CUDA out-of-memory."),
        timeseries("Memory cap held per tenant", PromTarget(f"{MEMORY_USED} / {MEMORY_CAP}", "{{tenant}}"),
                   unit="percentunit", w=8,
                   description=f"gpuscope share: used over cap. GPUTenantNearMemoryCap fires at "
                               f"{NEAR_CAP:.0%} held for minutes."),
        timeseries("Allocations refused at the memory cap",
                   PromTarget(sum_expr(names.TENANT_MEMORY_REFUSED_RATE, T, by=[T]), "{{tenant}}"),
                   unit="ops", w=8,
                   description="gpuscope share: allocations per second refused because they would take "
                               "the tenant past its cap; each is a CUDA out-of-memory error in one of its "
                               "processes (GPUTenantAllocationsRefused)."),
        timeseries("GPU time: charged against NVML",
                   PromTarget(GPU_RATE, "{{tenant}} charged"),
                   PromTarget(sum_expr(names.TENANT_NVML_BUSY_RATE, T, by=[T]), "{{tenant}} NVML"),
                   unit="percentunit", w=8,
                   description="gpuscope share: the GPU time charged to each tenant (what its processes "
                               "report) against the time NVML saw them busy. NVML well above the charge "
                               "is a process under-reporting (GPUTenantUnderReported); NVML needs a GPU."),
        timeseries("Processes outside the share controller",
                   PromTarget(sum_expr(names.UNMANAGED_PROCESSES, by=["instance"]), "{{instance}} processes"),
                   w=12,
                   description="gpuscope share: processes NVML lists on the controller's GPU that never "
                               "joined it; they run outside every share and memory cap. The controller's "
                               "log names each (GPUShareUnmanagedProcesses)."),
        timeseries("Memory of processes outside the share controller",
                   PromTarget(sum_expr(names.UNMANAGED_MEMORY, by=["instance"]), "{{instance}}"),
                   unit="bytes", w=12,
                   description="gpuscope share: device memory the processes that never joined hold, as "
                               "NVML reports it: no tenant's cap counts it."),
        timeseries("Queue wait p99 per tenant",
                   PromTarget(quantile_expr(0.99, m.REQUEST_QUEUE, T, by=[T]), "{{tenant}} p99"),
                   PromTarget(quantile_expr(0.5, m.REQUEST_QUEUE, T, by=[T]), "{{tenant}} p50"),
                   unit="s", w=12),
        heatmap("Queue wait", heatmap_expr(m.REQUEST_QUEUE, T), w=12,
                description="Queued to first scheduled, every selected tenant."),
        timeseries("Waiting requests per tenant", PromTarget(sum_expr(names.QUEUE_DEPTH, T, by=[T]),
                                                             "{{tenant}}"), w=12),
        timeseries("Recorded GPU-time share (starvation window)",
                   PromTarget(filtered(names.TENANT_GPU_SHARE, T), "{{instance}} {{tenant}}"),
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
