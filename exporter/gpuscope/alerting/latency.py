"""Latency: p50/p99 recording rules of the main histograms, and spike alerts against a baseline.

A spike is the short-window p99 at least ``latency_spike_ratio`` times the baseline p99, where the
baseline is the *median* of the recorded p99 over a long window. The median, not a long-window p99:
a long-window p99 would absorb the spike itself within minutes (5 m of slow samples are > 1% of an
hour), while the median only moves once the new level has held for half the window.

Traps this handles: one slow request (minimum traffic, and ``for`` longer than the window it stays
in); idle periods (quantiles are recorded only with traffic, so no NaN enters the baseline); a new
instance (its baseline is its own recent p99, ratio ~1).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuscope import catalogue as m
from gpuscope.alerting import names
from gpuscope.alerting.config import Profile
from gpuscope.alerting.rules import Alert, Doc, Group, Record, by, duration, num, query_value, sel
from gpuscope.dashboards import uids

KERNEL_LABELS = ("job", "instance", "op", "device")
ENDPOINT_LABELS = ("job", "instance")
TENANT_LABELS = ("job", "instance", "tenant")


def quantile_expr(metric: m.Metric, q: float, labels: Sequence[str], selector: str, window: int) -> str:
    """p-quantile over ``window``, present only while the histogram has samples (no NaN series)."""
    w = duration(window)
    return (f"histogram_quantile({num(q)}, sum by ({by([*labels, 'le'])}) "
            f"(rate({sel(metric.series('_bucket'), selector)}[{w}])))\n"
            f"and on ({by(labels)})\n"
            f"sum by ({by(labels)}) (rate({sel(metric.series('_count'), selector)}[{w}])) > 0")


def recorded_quantile(metric: m.Metric, q: float, labels: Sequence[str]) -> str:
    """p-quantile of the normalised bucket rates, present only while there are samples (no NaN series)."""
    buckets = names.rate(metric, "_bucket")
    return (f"histogram_quantile({num(q)}, sum by ({by([*labels, 'le'])}) ({buckets}))\n"
            f"and on ({by(labels)})\n"
            f"sum by ({by(labels)}) ({names.rate(metric, '_count')}) > 0")


def _quantile_records(metric: m.Metric, labels: Sequence[str], p: Profile, baseline: bool) -> list[Record]:
    records = [
        Record(names.quantile(metric, names.P50), recorded_quantile(metric, 0.5, labels)),
        Record(names.quantile(metric, names.P99), recorded_quantile(metric, 0.99, labels)),
    ]
    if baseline:
        p99 = names.quantile(metric, names.P99)
        records += [
            Record(names.quantile(metric, names.P99_BASELINE),
                   f"quantile_over_time(0.5, {p99}[{duration(p.windows.latency_baseline)}])"),
            Record(names.quantile(metric, names.SAMPLES_RATE),
                   f"sum by ({by(labels)}) ({names.rate(metric, '_count')})"),
        ]
    return records


def spike_expr(metric: m.Metric, min_rate: float, p: Profile) -> str:
    """Short p99 over baseline p99 (the alert's value), with the minimum-traffic guard."""
    p99, base = names.quantile(metric, names.P99), names.quantile(metric, names.P99_BASELINE)
    rate = names.quantile(metric, names.SAMPLES_RATE)
    return f"{p99} / {base} > {num(p.thresholds.latency_spike_ratio)}\nand\n{rate} >= {num(min_rate)}"


def kernel_spike_condition(p: Profile) -> str:
    """Kernel GPU time far above its baseline: queueing cannot raise it."""
    return spike_expr(m.REGION_GPU_SECONDS, p.thresholds.kernel_min_samples_per_s, p)


def step_spike_condition(p: Profile) -> str:
    """Inter-token latency far above its baseline, on a server without kernel timing (vLLM): the
    engine's step time as requests see it, which queueing cannot raise either."""
    return (f"{spike_expr(m.REQUEST_ITL, p.thresholds.kernel_min_samples_per_s, p)}\n"
            f"unless on ({by(ENDPOINT_LABELS)})\n{names.REGION_SAMPLES_RATE}")


def latency_spike_condition(p: Profile) -> str:
    """The latency-spike dimension of the composite: kernel time where it is timed, else step time."""
    return f"({kernel_spike_condition(p)})\nor\n({step_spike_condition(p)})"


def _detail(metric: m.Metric, labels: Sequence[str]) -> tuple[str, str]:
    match = ",".join(f"{label}='%s'" for label in labels)
    p99 = query_value(f"{names.quantile(metric, names.P99)}{{{match}}}", labels, "humanizeDuration")
    base = query_value(f"{names.quantile(metric, names.P99_BASELINE)}{{{match}}}", labels, "humanizeDuration")
    return p99, base


def groups(p: Profile) -> list[Group]:
    t, w = p.thresholds, p.windows
    window, baseline = duration(w.latency), duration(w.latency_baseline)
    ratio = num(t.latency_spike_ratio)
    k_p99, k_base = _detail(m.REGION_GPU_SECONDS, KERNEL_LABELS)
    alerts = [
        Alert(
            name="GPUKernelLatencySpike", expr=kernel_spike_condition(p), for_s=w.latency_for,
            evidence_s=w.latency,
            severity="warning", service=p.selectors.server_service, dashboard=uids.KERNELS,
            dashboard_vars=("instance", "op"),
            summary="GPU time of op {{ $labels.op }} spiked on {{ $labels.instance }}",
            description=(f"p99 GPU time of op {{{{ $labels.op }}}} on {{{{ $labels.instance }}}} "
                         f"({{{{ $labels.device }}}}) is {k_p99} over {window}, {{{{ $value | humanize }}}}× "
                         f"its baseline of {k_base} (median p99 over {baseline})."),
            doc=Doc(what="p99 GPU time of a timed op far above its usual p99 (one of the composite's "
                         "three dimensions)",
                    threshold=f"p99 ≥ {ratio}× baseline, ≥ {num(t.kernel_min_samples_per_s)} samples/s",
                    window=f"p99 over {window}, baseline = median p99 over {baseline}, for "
                           f"{duration(w.latency_for)}",
                    why="Kernel time is measured on the GPU, so queueing and load cannot raise it: a "
                        "sustained rise means slower kernels (throttling, contention, a bad build)."),
        ),
    ]
    i_p99, i_base = _detail(m.REQUEST_ITL, ENDPOINT_LABELS)
    alerts.append(Alert(
        name="GPUStepLatencySpike", expr=step_spike_condition(p), for_s=w.latency_for,
        evidence_s=w.latency, severity="warning", service=p.selectors.server_service, dashboard=uids.SLO,
        summary="Inter-token latency spiked on {{ $labels.instance }}",
        description=(f"p99 inter-token latency on {{{{ $labels.instance }}}} is {i_p99} over {window}, "
                     f"{{{{ $value | humanize }}}}× its baseline of {i_base} (median p99 over {baseline}); "
                     f"the server has no kernel timing, so this is its step time as requests see it."),
        doc=Doc(what="p99 inter-token latency far above its usual p99, on a server without kernel timing "
                     "(vLLM): the composite's latency dimension there",
                threshold=f"p99 ≥ {ratio}× baseline, ≥ {num(t.kernel_min_samples_per_s)} tokens/s",
                window=f"p99 over {window}, baseline = median p99 over {baseline}, for "
                       f"{duration(w.latency_for)}",
                why="Each token waits one engine step, so its gap rises with slower kernels and not with "
                    "queueing; where kernels are timed, GPUKernelLatencySpike says more and this stays "
                    "silent."),
    ))
    for key, metric in (("ttft", m.REQUEST_TTFT), ("e2e", m.REQUEST_E2E)):
        p99, base = _detail(metric, ENDPOINT_LABELS)
        alerts.append(Alert(
            name="GPURequestLatencySpike", expr=spike_expr(metric, t.request_min_requests_per_s, p),
            for_s=w.latency_for, severity="warning", service=p.selectors.server_service,
            dashboard=uids.SLO, labels={"latency": key},
            summary=f"Request {key.upper()} spiked on {{{{ $labels.instance }}}}",
            description=(f"p99 {key.upper()} on {{{{ $labels.instance }}}} is {p99} over {window}, "
                         f"{{{{ $value | humanize }}}}× its baseline of {base} "
                         f"(median p99 over {baseline})."),
            doc=Doc(what=f"p99 request {key.upper()} far above its usual p99",
                    threshold=f"p99 ≥ {ratio}× baseline, ≥ {num(t.request_min_requests_per_s)} requests/s",
                    window=f"p99 over {window}, baseline = median p99 over {baseline}, for "
                           f"{duration(w.latency_for)}",
                    why="What users feel. Not a composite dimension: queueing (starvation) and memory "
                        "pressure raise it too, so it would count one fault twice."),
        ))
    records = [
        *_quantile_records(m.REGION_GPU_SECONDS, KERNEL_LABELS, p, baseline=True),
        *_quantile_records(m.REQUEST_TTFT, ENDPOINT_LABELS, p, baseline=True),
        *_quantile_records(m.REQUEST_E2E, ENDPOINT_LABELS, p, baseline=True),
        *_quantile_records(m.REQUEST_ITL, ENDPOINT_LABELS, p, baseline=True),
        *_quantile_records(m.REQUEST_QUEUE, TENANT_LABELS, p, baseline=True),
    ]
    return [Group("gpuscope-latency", (*records, *alerts))]
