"""A server's /metrics (gpuscope serve, or vLLM under its own names), read into one flat reading.

Names come from the catalogue (gpuscope) and ``contract/upstream.py`` (vLLM): the same tables the
normalisation layer uses, so ``diagnose`` reads what the alerts read. Series split by tenant, model
or engine are summed (counters, histogram buckets) or, gauges, combined as their normalised series
combine them (``names.AGGREGATIONS``: the KV cache's usage is the highest, not a sum); per-op series
are kept per op.
"""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from gpuscope.contract import catalogue as cat
from gpuscope.contract import names, parts
from gpuscope.contract import upstream as up

#: quantity → (its normalised series, whose aggregation combines the splits; gpuscope sample name;
#: vLLM sample names, newest first)
GAUGES = {
    "running": (names.REQUESTS_RUNNING, cat.REQUESTS_RUNNING.name, (up.VLLM_RUNNING.name,)),
    "waiting": (names.QUEUE_DEPTH, cat.QUEUE_DEPTH.name, (up.VLLM_WAITING.name,)),
    "kv_cache": (names.KV_CACHE_USAGE, cat.KV_CACHE_USAGE.name,
                 (up.VLLM_KV_CACHE.name, up.VLLM_KV_CACHE_BEFORE_0_9)),
}
_COMBINE = {"sum": sum, "max": max, "min": min}
#: quantity → (gpuscope sample name, vLLM sample names, newest first)
COUNTERS = {
    "preemptions": (cat.PREEMPTIONS.name, (up.VLLM_PREEMPTIONS.name,)),
    "generation_tokens": (cat.GENERATION_TOKENS.name, (up.VLLM_GENERATION_TOKENS.name,)),
}
HISTOGRAMS = {
    "ttft": (cat.REQUEST_TTFT.name, (up.VLLM_TTFT.name,)),
    "itl": (cat.REQUEST_ITL.name, (up.VLLM_ITL.name, up.VLLM_ITL_BEFORE_0_11)),
    "queue": (cat.REQUEST_QUEUE.name, (up.VLLM_QUEUE.name,)),
}
#: Per-op region time and kernel busy ratio (gpuscope's timer only).
REGION = cat.REGION_GPU_SECONDS.name
BUSY = cat.REGION_GPU_BUSY_RATIO.name


@dataclass
class ServerReading:
    source: str  # "gpuscope-server" or "vllm"
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    #: quantity → {upper bound: cumulative count}
    histograms: dict[str, dict[float, float]] = field(default_factory=dict)
    #: op → {upper bound: cumulative count}
    regions: dict[str, dict[float, float]] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)


def parse(text: str) -> ServerReading:
    """One exposition → a reading; unknown series are ignored."""
    samples: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name].append(s)
    vllm = any(name.startswith("vllm:") for name in samples)
    reading = ServerReading(parts.VLLM.job if vllm else parts.SERVER.job)

    def pick(own: str, theirs: tuple[str, ...], suffix: str = "") -> list:
        for name in (theirs if vllm else (own,)):
            if samples.get(name + suffix):
                return samples[name + suffix]
        return []

    for key, (record, own, theirs) in GAUGES.items():
        if found := pick(own, theirs):
            reading.gauges[key] = _COMBINE[names.AGGREGATIONS[record]](s.value for s in found)
    for key, (own, theirs) in COUNTERS.items():
        if found := pick(own, theirs):
            reading.counters[key] = sum(s.value for s in found)
    for key, (own, theirs) in HISTOGRAMS.items():
        buckets: dict[float, float] = defaultdict(float)
        for s in pick(own, theirs, "_bucket"):
            buckets[float(s.labels["le"])] += s.value
        if buckets:
            reading.histograms[key] = dict(buckets)
    for s in samples.get(REGION + "_bucket", []):
        op = s.labels.get("op", "")
        reading.regions.setdefault(op, defaultdict(float))[float(s.labels["le"])] += s.value
    for s in samples.get(BUSY, []):
        op = s.labels.get("op", "")
        reading.busy[op] = max(reading.busy.get(op, 0.0), s.value)
    return reading


def fetch(url: str, timeout: float = 2.0) -> ServerReading:
    """GET ``url`` (a /metrics endpoint) and parse it; raises OSError (URLError) when unreachable."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return parse(response.read().decode("utf-8", errors="replace"))


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """``histogram_quantile`` over the increase between two cumulative bucket sets (linear within a
    bucket, Prometheus' rule); None without observations in between."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower

