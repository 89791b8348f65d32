"""Inference SLO: latency heatmaps and percentiles, throughput, outcomes, queue, batch and KV cache."""

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
    stat,
    tenant_var,
    timeseries,
)


def percentiles(title: str, metric: m.Metric, description: str) -> object:
    return timeseries(title, *(PromTarget(quantile_expr(q, metric), f"p{round(q * 100)}", exemplar=True)
                               for q in (0.5, 0.9, 0.99)), unit="s", w=8, description=description)


ERRORS = 'outcome=~"error|abort|rejected"'

dashboard = dashboard(
    uid=uids.SLO,
    title="gpuscope / Inference SLO",
    description="Time to first token, inter-token and end-to-end latency (vLLM's definitions and buckets), "
                "tokens/s, outcomes, queue depth, batch size and KV cache of the reference server.",
    tags=["server", "slo"],
    variables=[instance_var(), tenant_var()],
    panels=[
        stat("Requests / s", PromTarget(rate_expr(m.REQUESTS)), unit="reqps"),
        stat("Error ratio",
             PromTarget(f"(sum(rate({sel(m.REQUESTS, extra=ERRORS)}[$__rate_interval])) or vector(0))"
                        f" / sum(rate({sel(m.REQUESTS)}[$__rate_interval]))"),
             unit="percentunit", decimals=2,
             description="Requests ending in error, abort or rejection, over all finished requests."),
        stat("p99 TTFT", PromTarget(quantile_expr(0.99, m.REQUEST_TTFT)), unit="s"),
        stat("p99 inter-token", PromTarget(quantile_expr(0.99, m.REQUEST_ITL)), unit="s"),
        stat("Output tokens / s", PromTarget(rate_expr(m.GENERATION_TOKENS)), unit="short"),
        stat("KV cache in use", PromTarget(f"max({sel(m.KV_CACHE_USAGE)})"), unit="percentunit"),
        heatmap("Time to first token", heatmap_expr(m.REQUEST_TTFT), w=8,
                description="Arrival to first token. Exemplars carry trace_id: click one for that request's "
                            "logs in Loki."),
        heatmap("Inter-token latency", heatmap_expr(m.REQUEST_ITL), w=8),
        heatmap("End-to-end latency", heatmap_expr(m.REQUEST_E2E), w=8),
        percentiles("TTFT percentiles", m.REQUEST_TTFT, "From histogram buckets; exemplars shown."),
        percentiles("Inter-token percentiles", m.REQUEST_ITL, "Gap between consecutive output tokens."),
        percentiles("End-to-end percentiles", m.REQUEST_E2E, "Arrival to last token."),
        timeseries("Tokens / s",
                   PromTarget(rate_expr(m.GENERATION_TOKENS, by=["tenant"]), "output {{tenant}}"),
                   PromTarget(rate_expr(m.PROMPT_TOKENS, by=["tenant"]), "prompt {{tenant}}"), unit="short",
                   w=8),
        timeseries("Requests by outcome", PromTarget(rate_expr(m.REQUESTS, by=["outcome"]), "{{outcome}}"),
                   unit="reqps", stack=True, w=8),
        timeseries("Time per output token",
                   PromTarget(quantile_expr(0.5, m.REQUEST_TPOT), "p50", exemplar=True),
                   PromTarget(quantile_expr(0.99, m.REQUEST_TPOT), "p99", exemplar=True), unit="s", w=8),
        timeseries("Queue depth and running batch",
                   PromTarget(f"sum({sel(m.QUEUE_DEPTH)})", "waiting"),
                   PromTarget(f"sum({sel(m.REQUESTS_RUNNING)})", "running"), w=8),
        timeseries("Batch size",
                   PromTarget(f"sum by (phase) (rate({sel(m.BATCH_SIZE, '_sum')}[$__rate_interval]))"
                              f" / sum by (phase) (rate({sel(m.BATCH_SIZE, '_count')}[$__rate_interval]))",
                              "{{phase}} mean"),
                   PromTarget(quantile_expr(0.99, m.BATCH_SIZE, by=["phase"]), "{{phase}} p99"), w=8,
                   description="Requests per model step, by phase."),
        timeseries("KV cache usage", PromTarget(sel(m.KV_CACHE_USAGE), "{{instance}}"), unit="percentunit",
                   w=8),
        timeseries("Queue, prefill and decode time (p99)",
                   PromTarget(quantile_expr(0.99, m.REQUEST_QUEUE), "queue", exemplar=True),
                   PromTarget(quantile_expr(0.99, m.REQUEST_PREFILL), "prefill", exemplar=True),
                   PromTarget(quantile_expr(0.99, m.REQUEST_DECODE), "decode", exemplar=True),
                   unit="s", w=24),
        timeseries("SLO burn rate: TTFT",
                   PromTarget(f"max by (window) ({names.SLO_TTFT_BURN_RATE})", "{{window}}"), w=12,
                   description="Bad fraction over the error budget, per window (recorded by the alert "
                               "rules); pages at 14.4× over 1h/5m, 6× over 6h/30m."),
        timeseries("SLO burn rate: availability",
                   PromTarget(f"max by (window) ({names.SLO_AVAILABILITY_BURN_RATE})", "{{window}}"), w=12),
    ],
)
