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

from gpuscope.alerting.rules import Alert, Doc, Group, Record, query_value
from gpuscope.contract import catalogue as m
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import by, duration, histogram_quantile, num, sel

KERNEL_LABELS = ("job", "instance", "op", "device")
ENDPOINT_LABELS = ("job", "instance")
TENANT_LABELS = ("job", "instance", "tenant")


def _with_samples(q: float, buckets: str, count: str, labels: Sequence[str]) -> str:
    """The quantile of ``buckets`` per ``labels``, present only while ``count`` (the rate of the same
    histogram's count) is above 0: no NaN series."""
    return (f"{histogram_quantile(q, buckets, labels)}\n"
            f"and on ({by(labels)})\nsum by ({by(labels)}) ({count}) > 0")


def quantile_expr(metric: m.Metric, q: float, labels: Sequence[str], selector: str, window: int) -> str:
    """p-quantile over ``window`` of the source's own histogram, present only while it has samples."""
    w = duration(window)
    return _with_samples(q, f"rate({sel(metric.series('_bucket'), selector)}[{w}])",
                         f"rate({sel(metric.series('_count'), selector)}[{w}])", labels)


def recorded_quantile(metric: m.Metric, q: float, labels: Sequence[str]) -> str:
    """p-quantile of the normalised bucket rates, present only while there are samples."""
    return _with_samples(q, names.rate(metric, "_bucket"), names.rate(metric, "_count"), labels)


#: The baseline recorded for each quantile that a spike compares: the median over the baseline window.
BASELINE_OF = {names.P50: names.P50_BASELINE, names.P99: names.P99_BASELINE}


def _quantile_records(metric: m.Metric, labels: Sequence[str], p: Profile,
                      baseline: str = "") -> list[Record]:
    """p50 and p99, and with ``baseline`` (P50 or P99) that quantile's baseline and the sample rate."""
    records = [
        Record(names.quantile(metric, names.P50), recorded_quantile(metric, 0.5, labels)),
        Record(names.quantile(metric, names.P99), recorded_quantile(metric, 0.99, labels)),
    ]
    if baseline:
        recorded = names.quantile(metric, baseline)
        records += [
            Record(names.quantile(metric, BASELINE_OF[baseline]),
                   f"quantile_over_time(0.5, {recorded}[{duration(p.windows.latency_baseline)}])"),
            Record(names.quantile(metric, names.SAMPLES_RATE),
                   f"sum by ({by(labels)}) ({names.rate(metric, '_count')})"),
        ]
    return records


def spike_expr(metric: m.Metric, min_rate: float, p: Profile, q: str = names.P99) -> str:
    """Short-window quantile over its baseline (the alert's value), with the minimum-traffic guard."""
    now, base = names.quantile(metric, q), names.quantile(metric, BASELINE_OF[q])
    rate = names.quantile(metric, names.SAMPLES_RATE)
    return f"{now} / {base} > {num(p.thresholds.latency_spike_ratio)}\nand\n{rate} >= {num(min_rate)}"


def kernel_spike_condition(p: Profile) -> str:
    """Kernel GPU time far above its baseline: queueing cannot raise it."""
    return spike_expr(m.REGION_GPU_SECONDS, p.thresholds.kernel_min_samples_per_s, p)


def step_spike_condition(p: Profile) -> str:
    """Median inter-token latency far above its baseline, on a server without kernel timing (vLLM):
    the engine's step time as requests see it, which queueing cannot raise either. The median, not
    the p99: a token's gap also holds any prefill batched into the step before it (vLLM mixes
    prefills into decode steps), so the tail measures prefill interference, the median the step."""
    return (f"{spike_expr(m.REQUEST_ITL, p.thresholds.kernel_min_samples_per_s, p, names.P50)}\n"
            f"unless on ({by(ENDPOINT_LABELS)})\n{names.REGION_SAMPLES_RATE}")


def latency_spike_condition(p: Profile) -> str:
    """The latency-spike dimension of the composite: kernel time where it is timed, else step time."""
    return f"({kernel_spike_condition(p)})\nor\n({step_spike_condition(p)})"


def _detail(metric: m.Metric, labels: Sequence[str], q: str = names.P99) -> tuple[str, str]:
    match = ",".join(f"{label}='%s'" for label in labels)
    now = query_value(f"{names.quantile(metric, q)}{{{match}}}", labels, "humanizeDuration")
    base = query_value(f"{names.quantile(metric, BASELINE_OF[q])}{{{match}}}", labels, "humanizeDuration")
    return now, base


def _spike(p: Profile, metric: m.Metric, keys: Sequence[str], min_rate: float, rate_unit: str, *,
           subject: str, what: str, why: str, where: str = "", tail: str = "", q: str = names.P99,
           **alert) -> Alert:
    """A latency-spike alert: a short-window quantile against its baseline, as ``spike_expr``."""
    w = p.windows
    window, baseline = duration(w.latency), duration(w.latency_baseline)
    now, base = _detail(metric, keys, q)
    return Alert(
        for_s=w.latency_for, evidence_s=w.latency, severity="warning", service=p.selectors.server_service,
        description=(f"{q} {subject} on {{{{ $labels.instance }}}}{where} is {now} over {window}, "
                     f"{{{{ $value | humanize }}}}× its baseline of {base} (median {q} over "
                     f"{baseline}){tail}."),
        doc=Doc(what=what, threshold=f"{q} ≥ {num(p.thresholds.latency_spike_ratio)}× baseline, ≥ "
                                     f"{num(min_rate)} {rate_unit}",
                window=f"{q} over {window}, baseline = median {q} over {baseline}, for "
                       f"{duration(w.latency_for)}",
                why=why),
        **alert)


def groups(p: Profile) -> list[Group]:
    t = p.thresholds
    kernel_rate = t.kernel_min_samples_per_s
    alerts = [
        _spike(p, m.REGION_GPU_SECONDS, KERNEL_LABELS, kernel_rate, "samples/s",
               name="GPUKernelLatencySpike", expr=kernel_spike_condition(p), dashboard=uids.KERNELS,
               dashboard_vars=("instance", "op"),
               summary="GPU time of op {{ $labels.op }} spiked on {{ $labels.instance }}",
               subject="GPU time of op {{ $labels.op }}", where=" ({{ $labels.device }})",
               what="p99 GPU time of a timed op far above its usual p99 (one of the composite's three "
                    "dimensions)",
               why="Kernel time is measured on the GPU, so queueing and load cannot raise it: a sustained "
                   "rise means slower kernels (throttling, contention, a bad build)."),
        _spike(p, m.REQUEST_ITL, ENDPOINT_LABELS, kernel_rate, "tokens/s",
               name="GPUStepLatencySpike", expr=step_spike_condition(p), dashboard=uids.SLO, q=names.P50,
               summary="Inter-token latency spiked on {{ $labels.instance }}", subject="inter-token latency",
               tail="; the server has no kernel timing, so this is its step time as requests see it",
               what="Median inter-token latency far above its usual median, on a server without kernel "
                    "timing (vLLM): the composite's latency dimension there",
               why="Each token waits one engine step, so its gap rises with slower kernels and not with "
                   "queueing; the median, because prefills batched into a step lengthen the tail. Where "
                   "kernels are timed, GPUKernelLatencySpike says more and this stays silent."),
        *(_spike(p, metric, ENDPOINT_LABELS, t.request_min_requests_per_s, "requests/s",
                 name="GPURequestLatencySpike", expr=spike_expr(metric, t.request_min_requests_per_s, p),
                 dashboard=uids.SLO, labels={"latency": key},
                 summary=f"Request {key.upper()} spiked on {{{{ $labels.instance }}}}", subject=key.upper(),
                 what=f"p99 request {key.upper()} far above its usual p99",
                 why="What users feel. Not a composite dimension: queueing (starvation) and memory "
                     "pressure raise it too, so it would count one fault twice.")
          for key, metric in (("ttft", m.REQUEST_TTFT), ("e2e", m.REQUEST_E2E))),
    ]
    records = [
        *_quantile_records(m.REGION_GPU_SECONDS, KERNEL_LABELS, p, baseline=names.P99),
        *_quantile_records(m.REQUEST_TTFT, ENDPOINT_LABELS, p, baseline=names.P99),
        *_quantile_records(m.REQUEST_E2E, ENDPOINT_LABELS, p, baseline=names.P99),
        *_quantile_records(m.REQUEST_ITL, ENDPOINT_LABELS, p, baseline=names.P50),
        *_quantile_records(m.REQUEST_QUEUE, TENANT_LABELS, p, baseline=names.P99),
    ]
    return [Group("gpuscope-latency", (*records, *alerts))]
