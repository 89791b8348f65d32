"""Inference SLO: latency heatmaps and percentiles, throughput, outcomes, queue, batch and KV cache, for
gpuscope serve or vLLM through the normalised series (vLLM's model_name is the tenant)."""

from gpuscope.contract import catalogue as m
from gpuscope.contract import names as n
from gpuscope.contract import uids
from gpuscope.dashboards.common import (
    PromTarget,
    dashboard,
    filtered,
    heatmap,
    heatmap_expr,
    instance_var,
    quantile_expr,
    stat,
    sum_expr,
    tenant_var,
    timeseries,
)

T = "tenant"


def percentiles(title: str, metric: m.Metric, description: str) -> object:
    return timeseries(title, *(PromTarget(quantile_expr(q, metric, T), f"p{round(q * 100)}")
                               for q in (0.5, 0.9, 0.99)), unit="s", w=8, description=description)


ERRORS = 'outcome=~"error|abort|rejected"'

dashboard = dashboard(
    uid=uids.SLO,
    title="gpuscope / Inference SLO",
    description="Time to first token, inter-token and end-to-end latency (vLLM's definitions and buckets), "
                "tokens/s, outcomes, queue depth, batch size and KV cache of gpuscope serve or vLLM.",
    tags=["server", "slo"],
    variables=[instance_var(), tenant_var()],
    panels=[
        stat("Requests / s", PromTarget(sum_expr(n.REQUESTS_RATE, T)), unit="reqps"),
        stat("Error ratio",
             PromTarget(f"({sum_expr(n.REQUESTS_RATE, T, extra=ERRORS)} or vector(0))"
                        f" / {sum_expr(n.REQUESTS_RATE, T)}"),
             unit="percentunit", decimals=2,
             description="Requests ending in error, abort or rejection, over all finished requests."),
        stat("p99 TTFT", PromTarget(quantile_expr(0.99, m.REQUEST_TTFT, T)), unit="s"),
        stat("p99 inter-token", PromTarget(quantile_expr(0.99, m.REQUEST_ITL, T)), unit="s"),
        stat("Output tokens / s", PromTarget(sum_expr(n.GENERATION_TOKENS_RATE, T)), unit="short"),
        stat("KV cache in use", PromTarget(f"max({filtered(n.KV_CACHE_USAGE)})"), unit="percentunit"),
        heatmap("Time to first token", heatmap_expr(m.REQUEST_TTFT, T), w=8,
                description="Arrival to first token: requests per second in each bucket over the latency "
                            "window."),
        heatmap("Inter-token latency", heatmap_expr(m.REQUEST_ITL, T), w=8),
        heatmap("End-to-end latency", heatmap_expr(m.REQUEST_E2E, T), w=8),
        percentiles("TTFT percentiles", m.REQUEST_TTFT, "From histogram buckets."),
        percentiles("Inter-token percentiles", m.REQUEST_ITL, "Gap between consecutive output tokens."),
        percentiles("End-to-end percentiles", m.REQUEST_E2E, "Arrival to last token."),
        timeseries("Tokens / s",
                   PromTarget(sum_expr(n.GENERATION_TOKENS_RATE, T, by=[T]), "output {{tenant}}"),
                   PromTarget(sum_expr(n.PROMPT_TOKENS_RATE, T, by=[T]), "prompt {{tenant}}"), unit="short",
                   w=8),
        timeseries("Requests by outcome",
                   PromTarget(sum_expr(n.REQUESTS_RATE, T, by=["outcome"]), "{{outcome}}"),
                   unit="reqps", stack=True, w=8),
        timeseries("Time per output token",
                   PromTarget(quantile_expr(0.5, m.REQUEST_TPOT, T), "p50"),
                   PromTarget(quantile_expr(0.99, m.REQUEST_TPOT, T), "p99"), unit="s", w=8),
        timeseries("Queue depth and running batch",
                   PromTarget(sum_expr(n.QUEUE_DEPTH, T), "waiting"),
                   PromTarget(sum_expr(n.REQUESTS_RUNNING, T), "running"), w=8),
        timeseries("Batch size",
                   PromTarget(f"{sum_expr(n.BATCH_SIZE_SUM_RATE, by=['phase'])}"
                              f" / {sum_expr(n.BATCH_SIZE_COUNT_RATE, by=['phase'])}", "{{phase}} mean"),
                   PromTarget(quantile_expr(0.99, m.BATCH_SIZE, by=["phase"]), "{{phase}} p99"), w=8,
                   description="Requests per model step, by phase (gpuscope serve)."),
        timeseries("KV cache usage", PromTarget(filtered(n.KV_CACHE_USAGE), "{{instance}}"),
                   unit="percentunit", w=8),
        timeseries("Queue, prefill and decode time (p99)",
                   PromTarget(quantile_expr(0.99, m.REQUEST_QUEUE, T), "queue"),
                   PromTarget(quantile_expr(0.99, m.REQUEST_PREFILL, T), "prefill"),
                   PromTarget(quantile_expr(0.99, m.REQUEST_DECODE, T), "decode"),
                   unit="s", w=24),
        timeseries("SLO burn rate: TTFT",
                   PromTarget(f"max by (window) ({n.SLO_TTFT_BURN_RATE})", "{{window}}"), w=12,
                   description="Bad fraction over the error budget, per window (recorded by the alert "
                               "rules); pages at 14.4× over 1h/5m, 6× over 6h/30m."),
        timeseries("SLO burn rate: availability",
                   PromTarget(f"max by (window) ({n.SLO_AVAILABILITY_BURN_RATE})", "{{window}}"), w=12),
    ],
)
