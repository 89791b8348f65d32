"""Kernel timing: GPU time per op from ``gpuscope.timing`` histograms, and the timer's own health."""

from gpuscope import catalogue as m
from gpuscope.dashboards import uids
from gpuscope.dashboards.common import (
                    Heatmap,
                    PromTarget,
                    dashboard,
                    heatmap,
                    heatmap_expr,
                    instance_var,
                    op_var,
                    quantile_expr,
                    rate_expr,
                    sel,
                    stat,
                    table,
                    timeseries,
)

H = m.REGION_GPU_SECONDS
#: Estimated GPU seconds per second of each op, corrected for sampling:
#: mean sampled time × rate of entered regions (timed or not).
GPU_TIME_PER_S = (f"(sum by (op) (rate({sel(H, '_sum')}[$__rate_interval]))"
                  f" / sum by (op) (rate({sel(H, '_count')}[$__rate_interval])))"
                  f" * sum by (op) (rate({sel(m.REGIONS_ENTERED)}[$__rate_interval]))")

per_op: Heatmap = heatmap("GPU time of $op", heatmap_expr(H), w=24,
                          description="One heatmap per op (repeated over the op variable, three to a row); "
                                      "bright cells are where most regions landed; exemplars link to the "
                                      "request's logs.")
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
        stat("Timed regions / s", PromTarget(f"sum(rate({sel(H, '_count')}[$__rate_interval]))"), unit="ops"),
        stat("Timer overhead", PromTarget(f"max({sel(m.TIMER_OVERHEAD_RATIO)})"), unit="percentunit",
             decimals=2,
             description="Estimated share of wall time spent timing (callers' threads + resolver)."),
        stat("Hot path per region", PromTarget(f"max({sel(m.TIMER_HOT_PATH_SECONDS)})"), unit="s",
             description="CPU cost of timing one region on the caller's thread."),
        stat("Dropped samples / s", PromTarget(f"sum(rate({sel(m.TIMER_DROPPED)}[$__rate_interval]))"),
             unit="ops"),
        stat("Resolver lag", PromTarget(f"max({sel(m.TIMER_RESOLVER_LAG_SECONDS)})"), unit="s"),
        stat("Pending samples", PromTarget(f"sum({sel(m.TIMER_PENDING)})")),
        heatmap("GPU time, all selected ops", heatmap_expr(H), w=24, h=9,
                description="sum by (le) of bucket increases per interval over every selected op."),
        per_op,
        timeseries("p50 and p99 GPU time per op",
                   PromTarget(quantile_expr(0.5, H, by=["op"]), "{{op}} p50", exemplar=True),
                   PromTarget(quantile_expr(0.99, H, by=["op"]), "{{op}} p99", exemplar=True),
                   unit="s", w=16),
        timeseries("Share of GPU time by op",
                   PromTarget(f"{GPU_TIME_PER_S} / ignoring(op) group_left sum({GPU_TIME_PER_S})", "{{op}}"),
                   unit="percentunit", stack=True, w=8,
                   description="Embedding / attention / MLP … share of estimated GPU time, corrected for "
                               "each op's sampling ratio."),
        timeseries("GPU seconds per second by op", PromTarget(GPU_TIME_PER_S, "{{op}}"), unit="s",
                   stack=True, description="Estimated GPU time per wall second (1 = one GPU fully busy)."),
        timeseries("Sampling ratio per op", PromTarget(sel(m.TIMER_SAMPLING_RATIO), "{{instance}} {{op}}"),
                   unit="percentunit"),
        timeseries("Dropped samples by reason",
                   PromTarget(rate_expr(m.TIMER_DROPPED, by=["reason"]), "{{reason}}"), unit="ops"),
        timeseries("Timer overhead against budget",
                   PromTarget(sel(m.TIMER_OVERHEAD_RATIO), "{{instance}} overhead"),
                   PromTarget(sel(m.TIMER_OVERHEAD_BUDGET_RATIO), "{{instance}} budget"),
                   unit="percentunit"),
        timeseries("Resolver lag and ring occupancy",
                   PromTarget(sel(m.TIMER_RESOLVER_LAG_SECONDS), "{{instance}} lag (s)"),
                   PromTarget(sel(m.TIMER_PENDING), "{{instance}} pending samples"), unit="short"),
        table("Timer backend and calibrated baseline",
              PromTarget(sel(m.TIMER_BACKEND), instant=True, format="table"),
              PromTarget(sel(m.TIMER_BASELINE_SECONDS), instant=True, format="table"),
              exclude=("Time", "__name__", "job")),
    ],
)
