"""Kernel timing: GPU time per op from ``gpuscope.timing`` histograms, and the timer's own health
(gpuscope serve only: vLLM times no kernels)."""

from gpuscope.contract import catalogue as m
from gpuscope.contract import names as n
from gpuscope.contract import uids
from gpuscope.dashboards.common import (
                    Heatmap,
                    PromTarget,
                    dashboard,
                    filtered,
                    heatmap,
                    heatmap_expr,
                    instance_var,
                    op_var,
                    quantile_expr,
                    stat,
                    sum_expr,
                    table,
                    timeseries,
)

H = m.REGION_GPU_SECONDS
#: Estimated GPU seconds per second of each op, corrected for sampling:
#: mean sampled time × rate of entered regions (timed or not).
GPU_TIME_PER_S = (f"({sum_expr(n.REGION_SUM_RATE, 'op', by=['op'])}"
                  f" / {sum_expr(n.REGION_COUNT_RATE, 'op', by=['op'])})"
                  f" * {sum_expr(n.REGIONS_ENTERED_RATE, 'op', by=['op'])}")

per_op: Heatmap = heatmap("GPU time of $op", heatmap_expr(H, "op"), w=24,
                          description="One heatmap per op (repeated over the op variable, three to a row); "
                                      "bright cells are where most regions landed.")
per_op.repeat.variable = "op"
per_op.repeat.direction = "h"
per_op.repeat.maxPerRow = 3

dashboard = dashboard(
    uid=uids.KERNELS,
    title="gpuscope / Kernel timing",
    description="Per-op GPU time measured with CUDA event pairs (baseline subtracted), and timer health.",
    tags=["timing"],
    variables=[instance_var(), op_var()],
    panels=[
        stat("Timed regions / s", PromTarget(sum_expr(n.REGION_COUNT_RATE, "op")), unit="ops"),
        stat("Timer overhead", PromTarget(f"max({filtered(n.TIMER_OVERHEAD)})"), unit="percentunit",
             decimals=2,
             description="Estimated share of wall time spent timing (callers' threads + resolver)."),
        stat("Hot path per region", PromTarget(f"max({filtered(n.TIMER_HOT_PATH)})"), unit="s",
             description="CPU cost of timing one region on the caller's thread."),
        stat("Dropped samples / s", PromTarget(sum_expr(n.TIMER_DROPPED_RATE)), unit="ops"),
        stat("Resolver lag", PromTarget(f"max({filtered(n.TIMER_RESOLVER_LAG)})"), unit="s"),
        stat("Pending samples", PromTarget(sum_expr(n.TIMER_PENDING))),
        heatmap("GPU time, all selected ops", heatmap_expr(H, "op"), w=24, h=9,
                description="sum by (le) of bucket increases per interval over every selected op."),
        per_op,
        timeseries("p50 and p99 GPU time per op",
                   PromTarget(quantile_expr(0.5, H, "op", by=["op"]), "{{op}} p50"),
                   PromTarget(quantile_expr(0.99, H, "op", by=["op"]), "{{op}} p99"),
                   unit="s", w=16),
        timeseries("Share of GPU time by op",
                   PromTarget(f"{GPU_TIME_PER_S} / ignoring(op) group_left sum({GPU_TIME_PER_S})", "{{op}}"),
                   unit="percentunit", stack=True, w=8,
                   description="Embedding / attention / MLP … share of estimated GPU time, corrected for "
                               "each op's sampling ratio."),
        timeseries("GPU seconds per second by op", PromTarget(GPU_TIME_PER_S, "{{op}}"), unit="s",
                   stack=True, description="Estimated GPU time per wall second (1 = one GPU fully busy)."),
        timeseries("Kernel busy share per op",
                   PromTarget(filtered(n.REGION_GPU_BUSY_RATIO, "op"), "{{instance}} {{op}}"),
                   unit="percentunit",
                   description="Share of each op's region time its own kernels keep the GPU busy, from the "
                               "latest sampled CUPTI window (gpuscope serve --timing.kernel-busy). Near 1: "
                               "GPU-bound; well under 1: the GPU waits for launches (region time includes "
                               "those waits)."),
        timeseries("Sampling ratio per op",
                   PromTarget(filtered(n.TIMER_SAMPLING_RATIO, "op"), "{{instance}} {{op}}"),
                   unit="percentunit"),
        timeseries("Dropped samples by reason",
                   PromTarget(sum_expr(n.TIMER_DROPPED_RATE, by=["reason"]), "{{reason}}"), unit="ops"),
        timeseries("Timer overhead against budget",
                   PromTarget(filtered(n.TIMER_OVERHEAD), "{{instance}} overhead"),
                   PromTarget(filtered(n.TIMER_OVERHEAD_BUDGET), "{{instance}} budget"),
                   unit="percentunit"),
        timeseries("Resolver lag and ring occupancy",
                   PromTarget(filtered(n.TIMER_RESOLVER_LAG), "{{instance}} lag (s)"),
                   PromTarget(filtered(n.TIMER_PENDING), "{{instance}} pending samples"), unit="short"),
        table("Timer backend and calibrated baseline",
              PromTarget(filtered(n.TIMER_BACKEND), instant=True, format="table"),
              PromTarget(filtered(n.TIMER_BASELINE), instant=True, format="table"),
              exclude=("Time", "__name__", "job")),
    ],
)
