"""Where the metrics come from: one normalisation layer of recording rules per source.

A source is a program whose metrics the bundle can read: ``gpuscope-server`` and ``vllm`` (the
*server* role: requests, queues, memory of the serving process), ``gpuscope-exporter`` and
``dcgm-exporter`` (the *GPU* role: per-GPU state). ``Profile.sources`` (``gpuscope.contract.profiles``)
picks the ones that run; each becomes one rule group, ``gpuscope-source-<name>``, that records the
normalised series of ``names`` from that source's own metrics. Everything else (alerts, the
composite, SLO burn rates, bottleneck classes, every dashboard panel) reads only normalised series, so
it is the same for every source. Why the layer records first aggregations (rates, floors) rather than
copies of raw series: docs/sources.md.

Each source is a table ``quantity → Raw`` (name, label renames, unit scale, labels to aggregate away)
plus a few expressions of its own (``Source.custom``); a quantity a source lacks has no entry, and the
alerts and panels that need it are silent for that source (the support table in docs/sources.md is
computed from the generated rules).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gpuscope.alerting import dcgm, memory, slo, workload
from gpuscope.alerting.rules import Group, Record
from gpuscope.contract import catalogue as m
from gpuscope.contract import names, parts
from gpuscope.contract import upstream as up
from gpuscope.contract.choices import MetricNames
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import by, duration, sel

Role = Literal["server", "gpu"]
_MIB = 1 << 20


@dataclass(frozen=True)
class Raw:
    """How one source exposes one quantity."""

    #: The exposed name (a histogram's family name, without ``_bucket``).
    metric: str
    #: Canonical label → the source's label carrying it (``tenant`` ← vLLM's ``model_name``).
    labels: Mapping[str, str] = field(default_factory=dict)
    #: Factor to base units (dcgm-exporter's MiB → bytes, MHz → Hz, mJ → J, % → ratio).
    scale: float = 1.0
    #: An older name of the same series, read where ``metric`` is absent (vLLM before a rename).
    fallback: str = ""
    #: Source labels the normalised series aggregates away (vLLM's engine, dcgm-exporter's identity).
    drop: tuple[str, ...] = ()
    #: Extra matchers on the source's own labels (e.g. one ``call``).
    matchers: tuple[str, ...] = ()
    #: A series added to ``metric`` (dcgm-exporter's capacity: free + used).
    plus: str = ""
    #: Rewrite the source's series before the labels are renamed and aggregated (dcgm-exporter: each
    #: MIG instance its own ``gpu``).
    prepare: Callable[[str], str] | None = None
    #: How a counter's rates over the dropped labels combine, where not summed (copies of one device
    #: counter, which must not add up).
    combine: str = ""

    def selector(self, selector: str, suffix: str = "", *matchers: str, name: str = "") -> str:
        """The source's series (``name`` or ``metric + suffix``, plus ``plus``) under its job selector;
        ``matchers`` are on canonical labels and land on the source's label that carries each."""
        own = [re.sub(r"^\w+", lambda x: self.labels.get(x.group(), x.group()), m) for m in matchers]
        expr = sel(name or self.metric + suffix, selector, *self.matchers, *own)
        return f"({expr} + {sel(self.plus, selector)})" if self.plus else expr

    def normalise(self, expr: str, aggregation: str) -> str:
        """Rename labels, aggregate away what the canonical series does not keep, scale to base units."""
        if self.prepare is not None:
            expr = self.prepare(expr)
        for canonical, own in self.labels.items():
            expr = f'label_replace({expr}, "{canonical}", "$1", "{own}", "(.*)")'
        drop = (*self.drop, *self.labels.values())
        if drop or aggregation == "group":
            expr = f"{aggregation} without ({by(drop)}) (\n  {expr}\n)"
        if self.scale == 1:
            return expr
        inverse = 1 / self.scale
        return f"{expr} / {inverse:.15g}" if inverse == round(inverse) else f"{expr} * {self.scale:.15g}"


@dataclass(frozen=True)
class Source:
    """One source: its role, where its metric names come from, and how each quantity maps."""

    name: str
    role: Role
    title: str
    #: The upstream file (and version) whose names, labels and units the mapping follows.
    upstream: str
    #: ``Selectors`` field holding the matcher of this source's scrape job.
    selector_field: str
    raw: Mapping[str, Raw]
    #: Records the table cannot express: name → expression builder (profile, job selector).
    custom: Mapping[str, Callable[[Profile, str], str]] = field(default_factory=dict)
    #: What the support table says about the quantities this source lacks or reads differently.
    notes: tuple[str, ...] = ()

    def selector(self, p: Profile) -> str:
        return getattr(p.selectors, self.selector_field)


# --- what is normalised ---------------------------------------------------------------------------------

#: Histograms: quantity → (catalogue metric the names derive from, whether a panel needs its sum).
HISTOGRAMS: dict[str, tuple[m.Metric, bool]] = {
    "region": (m.REGION_GPU_SECONDS, True), "ttft": (m.REQUEST_TTFT, False),
    "itl": (m.REQUEST_ITL, False), "tpot": (m.REQUEST_TPOT, False), "e2e": (m.REQUEST_E2E, False),
    "queue": (m.REQUEST_QUEUE, False), "prefill": (m.REQUEST_PREFILL, False),
    "decode": (m.REQUEST_DECODE, False), "batch_size": (m.BATCH_SIZE, True),
}
#: Counters, as rates: quantity → (record, window field, suffix of the source series). The window is
#: the one the alert reading it uses; dashboards show the same rate.
COUNTERS: dict[str, tuple[str, str, str]] = {
    "requests": (names.REQUESTS_RATE, "latency", ""),
    "prompt_tokens": (names.PROMPT_TOKENS_RATE, "latency", ""),
    "generation_tokens": (names.GENERATION_TOKENS_RATE, "starvation", ""),
    "preemptions": (names.PREEMPTIONS_RATE, "latency", ""),
    "tenant_gpu_seconds": (names.TENANT_GPU_SECONDS_RATE, "starvation", ""),
    "regions_entered": (names.REGIONS_ENTERED_RATE, "latency", ""),
    "timer_dropped": (names.TIMER_DROPPED_RATE, "timer_drop", ""),
    "region_timed": (names.TIMER_TIMED_RATE, "timer_drop", "_count"),
    "log_dropped": (names.LOG_RECORDS_DROPPED_RATE, "latency", ""),
    "gpu_energy": (names.GPU_ENERGY_RATE, "latency", ""),
    "gpu_ecc": (names.GPU_ECC_ERRORS_RATE, "latency", ""),
    "gpu_pcie_replay": (names.GPU_PCIE_REPLAY_RATE, "latency", ""),
    "exporter_errors": (names.EXPORTER_ERRORS_RATE, "latency", ""),
    "tenant_memory_refused": (names.TENANT_MEMORY_REFUSED_RATE, "latency", ""),
    "tenant_nvml_busy": (names.TENANT_NVML_BUSY_RATE, "starvation", ""),
}
#: Gauges: quantity → record. How a source's splits of each combine is the contract's
#: (``names.AGGREGATIONS``).
GAUGES: dict[str, str] = {
    "queue_depth": names.QUEUE_DEPTH, "running": names.REQUESTS_RUNNING,
    "quota": names.TENANT_SHARE_QUOTA, "kv_cache": names.KV_CACHE_USAGE,
    "memory_allocated": names.DEVICE_MEMORY_ALLOCATED, "memory_reserved": names.DEVICE_MEMORY_RESERVED,
    "memory_total": names.DEVICE_MEMORY_TOTAL,
    "timer_sampling_ratio": names.TIMER_SAMPLING_RATIO, "timer_hot_path": names.TIMER_HOT_PATH,
    "timer_overhead": names.TIMER_OVERHEAD, "timer_budget": names.TIMER_OVERHEAD_BUDGET,
    "timer_baseline": names.TIMER_BASELINE, "timer_lag": names.TIMER_RESOLVER_LAG,
    "timer_pending": names.TIMER_PENDING, "timer_backend": names.TIMER_BACKEND,
    "busy_ratio": names.REGION_GPU_BUSY_RATIO, "log_queue": names.LOG_QUEUE_RECORDS,
    "gpu_info": names.GPU_INFO, "gpu_utilization": names.GPU_UTILIZATION,
    "gpu_memory_utilization": names.GPU_MEMORY_UTILIZATION,
    "gpu_memory_used": names.GPU_MEMORY_USED, "gpu_memory_total": names.GPU_MEMORY_TOTAL,
    "gpu_temperature": names.GPU_TEMPERATURE, "gpu_memory_temperature": names.GPU_MEMORY_TEMPERATURE,
    "gpu_power": names.GPU_POWER, "gpu_power_limit": names.GPU_POWER_LIMIT,
    "gpu_sm_clock": names.GPU_SM_CLOCK, "gpu_memory_clock": names.GPU_MEMORY_CLOCK,
    "gpu_pstate": names.GPU_PSTATE,
    "exporter_gpus": names.EXPORTER_GPUS, "exporter_gpu_up": names.EXPORTER_GPU_UP,
    "exporter_staleness": names.EXPORTER_STALENESS,
    "exporter_collection": names.EXPORTER_COLLECTION_SECONDS,
    "exporter_init_errors": names.EXPORTER_INIT_ERRORS,
    "tenant_memory_used": names.TENANT_MEMORY_USED, "tenant_memory_cap": names.TENANT_MEMORY_CAP,
    "tenant_under_reported": names.TENANT_UNDER_REPORTED,
    "unmanaged_processes": names.UNMANAGED_PROCESSES, "unmanaged_memory": names.UNMANAGED_MEMORY,
}
#: The memory whose floor the leak rules watch, per role: (used, capacity) quantities and the records.
MEMORY = {
    "server": ("memory_allocated", "memory_total", memory.SERVER_LABELS,
               (names.MEMORY_GROWTH_RATE, names.MEMORY_GROWTH_RATE_FAST,
                names.MEMORY_HEADROOM, names.MEMORY_HEADROOM_FAST)),
    "gpu": ("gpu_memory_used", "gpu_memory_total", memory.GPU_LABELS,
            (names.GPU_MEMORY_GROWTH_RATE, names.GPU_MEMORY_GROWTH_RATE_FAST,
             names.GPU_MEMORY_HEADROOM, names.GPU_MEMORY_HEADROOM_FAST)),
}


def _windowed(raw: Raw, fn: str, suffix: str, window: int, selector: str, aggregation: str,
              *matchers: str) -> str:
    w = duration(window)
    inner = f"{fn}({raw.selector(selector, suffix, *matchers)}[{w}])"
    if raw.fallback:
        old = raw.selector(selector, "", *matchers, name=raw.fallback + suffix)
        inner = f"({inner} or {fn}({old}[{w}]))"
    return raw.normalise(inner, aggregation)


def _instant(raw: Raw, selector: str, aggregation: str) -> str:
    inner = raw.selector(selector)
    if raw.fallback:
        inner = f"({inner} or {raw.selector(selector, name=raw.fallback)})"
    return raw.normalise(inner, aggregation)


def _memory_records(src: Source, p: Profile, selector: str) -> list[Record]:
    used_key, total_key, labels, records = MEMORY[src.role]
    used, total = src.raw.get(used_key), src.raw.get(total_key)
    if used is None or total is None:
        return []
    growth, growth_fast, headroom, headroom_fast = records
    used_sel, total_expr = used.selector(selector), total.selector(selector)
    wrap = (lambda e: used.normalise(e, "max")) if used.drop or used.scale != 1 else (lambda e: e)
    if used.drop or used.prepare is not None:
        # The source's own series split one memory (per workload pod, whose old series lingers in
        # the range windows after a replacement: workload.py) or share a join key (dcgm-exporter's
        # MIG instances share ``gpu``): the joins below would match many-to-many. Read the
        # normalised series recorded above instead, one per canonical key, already in bytes.
        used_sel, total_expr = sel(GAUGES[used_key], selector), sel(GAUGES[total_key], selector)
        wrap = lambda e: e  # noqa: E731
    w = p.windows
    # A serving process' restart shows in its own start time (the scrape's process collector); a
    # GPU's framebuffer outlives the processes on it, so the GPU role has only the memory series.
    start_time = sel("process_start_time_seconds", selector) if src.role == "server" else ""
    return [
        Record(growth, wrap(memory.growth_rate_record(used_sel, labels, p))),
        Record(growth_fast, wrap(memory.fast_rate_record(used_sel, p))),
        Record(headroom, wrap(memory.headroom(used_sel, total_expr, w.leak_floor, labels))),
        Record(headroom_fast, wrap(memory.headroom(used_sel, total_expr, w.leak_fast_floor, labels,
                                                   min_age=w.leak_fast_min_age,
                                                   restart_ratio=p.thresholds.leak_restart_ratio,
                                                   start_time=start_time))),
    ]


def records(src: Source, p: Profile) -> list[Record]:
    """The normalisation layer of one source: every normalised series it can record."""
    s, w = src.selector(p), p.windows
    out: list[Record] = []
    up, absent = names.TARGETS[src.role]
    out += [Record(up, f"up{{{s}}}"), Record(absent, f"absent(up{{{s}}})")]
    for key, (metric, with_sum) in HISTOGRAMS.items():
        if (raw := src.raw.get(key)) is None:
            continue
        for suffix in ("_bucket", "_count", *(("_sum",) if with_sum else ())):
            expr = _windowed(raw, "rate", suffix, w.latency, s, "sum")
            out.append(Record(names.rate(metric, suffix), expr))
    for key, (record, window, suffix) in COUNTERS.items():
        if (raw := src.raw.get(key)) is not None:
            rates = _windowed(raw, "rate", suffix, getattr(w, window), s, raw.combine or "sum")
            out.append(Record(record, rates))
    combine = names.AGGREGATIONS
    for key, record in GAUGES.items():
        if key in src.custom:
            out.append(Record(record, src.custom[key](p, s)))
        elif (raw := src.raw.get(key)) is not None:
            out.append(Record(record, _instant(raw, s, combine[record])))
    if (depth := src.raw.get("queue_depth")) is not None:
        backlog = _windowed(depth, "min_over_time", "", w.starvation, s, combine[names.QUEUE_DEPTH])
        out.append(Record(names.TENANT_BACKLOG, backlog))
    if (devices := src.raw.get("devices")) is not None:
        out.append(Record(names.SERVER_DEVICE, _instant(devices, s, combine[names.SERVER_DEVICE])))
    for key in ("clock_event", "xid_code", "xid", "gpus_lost"):
        if key in src.custom:
            record = {"clock_event": names.GPU_CLOCK_EVENT_RATIO, "xid_code": names.GPU_XID_CODE,
                      "xid": names.GPU_XID_RECENT, "gpus_lost": names.EXPORTER_GPUS_LOST}[key]
            out.append(Record(record, src.custom[key](p, s)))
    out += _memory_records(src, p, s)
    if (ttft := src.raw.get("ttft")) is not None and (requests := src.raw.get("requests")) is not None:
        out += slo.source_records(p, s, ttft, requests)
    return out


def group(src: Source, p: Profile) -> Group:
    return Group(f"gpuscope-source-{src.name}", tuple(records(src, p)))


# --- the sources ------------------------------------------------------------------------------------------

GPUSCOPE_SERVER = Source(
    name=parts.SERVER.job, role="server", title="gpuscope serve",
    upstream="src/gpuscope/contract/catalogue.py (this repository)", selector_field="server",
    raw={key: Raw(metric.name) for key, metric in {
        "region": m.REGION_GPU_SECONDS, "ttft": m.REQUEST_TTFT, "itl": m.REQUEST_ITL, "tpot": m.REQUEST_TPOT,
        "e2e": m.REQUEST_E2E, "queue": m.REQUEST_QUEUE, "prefill": m.REQUEST_PREFILL,
        "decode": m.REQUEST_DECODE, "batch_size": m.BATCH_SIZE, "requests": m.REQUESTS,
        "prompt_tokens": m.PROMPT_TOKENS, "generation_tokens": m.GENERATION_TOKENS,
        "preemptions": m.PREEMPTIONS, "tenant_gpu_seconds": m.TENANT_GPU_SECONDS,
        "regions_entered": m.REGIONS_ENTERED, "timer_dropped": m.TIMER_DROPPED,
        "region_timed": m.REGION_GPU_SECONDS, "log_dropped": m.LOG_RECORDS_DROPPED,
        "queue_depth": m.QUEUE_DEPTH, "running": m.REQUESTS_RUNNING, "quota": m.TENANT_SHARE_QUOTA,
        "kv_cache": m.KV_CACHE_USAGE, "memory_allocated": m.DEVICE_MEMORY_ALLOCATED,
        "memory_reserved": m.DEVICE_MEMORY_RESERVED, "memory_total": m.DEVICE_MEMORY_TOTAL,
        "devices": m.DEVICE_MEMORY_TOTAL, "timer_sampling_ratio": m.TIMER_SAMPLING_RATIO,
        "timer_hot_path": m.TIMER_HOT_PATH_SECONDS, "timer_overhead": m.TIMER_OVERHEAD_RATIO,
        "timer_budget": m.TIMER_OVERHEAD_BUDGET_RATIO, "timer_baseline": m.TIMER_BASELINE_SECONDS,
        "timer_lag": m.TIMER_RESOLVER_LAG_SECONDS, "timer_pending": m.TIMER_PENDING,
        "timer_backend": m.TIMER_BACKEND, "busy_ratio": m.REGION_GPU_BUSY_RATIO,
        "log_queue": m.LOG_QUEUE_RECORDS,
    }.items()},
)


def _gpuscope_xid(p: Profile, s: str) -> str:
    w = p.windows.xid
    errors, last = sel(m.GPU_XID_ERRORS.name, s), sel(m.GPU_XID_LAST.name, s)
    return (f"group without ({by(workload.DROP)}) (\n  increase({errors}[{duration(w)}]) > 0\n  or\n"
            f"  time() - {last} < {w}\n)")


def _gpuscope_info(p: Profile, s: str) -> str:
    """The exporter's GPU identity, with the workload its pod attribution puts on the per-GPU series."""
    workloads = workload.per_gpu(sel(m.GPU_MEMORY_USED.name, s), s)
    return workload.with_workload(sel(m.GPU_INFO.name, s), workloads)


#: Per-GPU series of the bundle's exporter: with pod attribution on, each carries the workload's labels
#: (workload.py), which the normalised series drop.
_PER_GPU = {"drop": workload.DROP}


GPUSCOPE_EXPORTER = Source(
    name=parts.EXPORTER.job, role="gpu", title="gpuscope exporter",
    upstream="src/gpuscope/contract/catalogue.py (this repository)", selector_field="exporter",
    raw={**{key: Raw(metric.name, **_PER_GPU) for key, metric in {
        "gpu_utilization": m.GPU_UTILIZATION,
        "gpu_memory_utilization": m.GPU_MEMORY_UTILIZATION, "gpu_memory_used": m.GPU_MEMORY_USED,
        "gpu_memory_total": m.GPU_MEMORY_TOTAL, "gpu_temperature": m.GPU_TEMPERATURE,
        "gpu_memory_temperature": m.GPU_MEMORY_TEMPERATURE, "gpu_power": m.GPU_POWER,
        "gpu_power_limit": m.GPU_POWER_LIMIT, "gpu_sm_clock": m.GPU_SM_CLOCK,
        "gpu_memory_clock": m.GPU_MEMORY_CLOCK, "gpu_pstate": m.GPU_PSTATE, "gpu_energy": m.GPU_ENERGY,
        "gpu_ecc": m.GPU_ECC_ERRORS, "gpu_pcie_replay": m.GPU_PCIE_REPLAY,
    }.items()}, **{key: Raw(metric.name) for key, metric in {
        "gpu_info": m.GPU_INFO, "exporter_gpus": m.EXPORTER_GPUS,
        "exporter_gpu_up": m.EXPORTER_GPU_UP, "exporter_staleness": m.EXPORTER_STALENESS,
        "exporter_collection": m.EXPORTER_COLLECTION_SECONDS, "exporter_errors": m.EXPORTER_ERRORS,
    }.items()}, "exporter_init_errors": Raw(m.EXPORTER_ERRORS.name, matchers=('call="nvmlInit"',))},
    custom={
        "gpu_info": _gpuscope_info,
        "clock_event": lambda p, s: (
            f"sum without ({by(workload.DROP)}) (\n  rate({sel(m.GPU_CLOCK_EVENT_SECONDS.name, s)}"
            f"[{duration(p.windows.throttle)}])\n)"),
        "xid": _gpuscope_xid,
        "gpus_lost": lambda p, s: (f"increase({sel(m.EXPORTER_GPUS_LOST.name, s)}"
                                   f"[{duration(p.windows.xid)}])"),
    },
    notes=(
        "With pod attribution (Kubernetes), the workload's `pod`, `namespace` and `container` on every "
        "`gpuscope_gpu_*` series are aggregated away (they change when the pod is replaced), and kept on "
        "`gpuscope:gpu:info`, from which GPU alerts join them.",
    ),
)

# vLLM (V1 engine). Every series carries model_name (the served model) and engine (the data-parallel
# engine index); the normalised series key them as tenant (one queue per served model) and sum engines.
_VLLM = {"labels": {"tenant": "model_name"}, "drop": ("engine",)}


def _vllm(name: str, fallback: str = "", **kw) -> Raw:
    return Raw(name, fallback=fallback, **{**_VLLM, **kw})


VLLM = Source(
    name=parts.VLLM.job, role="server", title="vLLM (V1 engine)",
    upstream="vllm-project/vllm vllm/v1/metrics/loggers.py (PrometheusStatLogger), v0.12",
    selector_field="vllm",
    raw={
        "ttft": _vllm(up.VLLM_TTFT.name),
        "itl": _vllm(up.VLLM_ITL.name, fallback=up.VLLM_ITL_BEFORE_0_11),
        "tpot": _vllm(up.VLLM_TPOT.name), "e2e": _vllm(up.VLLM_E2E.name), "queue": _vllm(up.VLLM_QUEUE.name),
        "prefill": _vllm(up.VLLM_PREFILL.name), "decode": _vllm(up.VLLM_DECODE.name),
        "requests": _vllm(up.VLLM_REQUEST_SUCCESS.name,
                          labels={"tenant": "model_name", "outcome": "finished_reason"}),
        "prompt_tokens": _vllm(up.VLLM_PROMPT_TOKENS.name),
        # Per engine (kept, not summed): starvation is judged per data-parallel engine (scheduling.py).
        "generation_tokens": _vllm(up.VLLM_GENERATION_TOKENS.name, drop=()),
        "preemptions": _vllm(up.VLLM_PREEMPTIONS.name),
        "queue_depth": _vllm(up.VLLM_WAITING.name, drop=()), "running": _vllm(up.VLLM_RUNNING.name),
        "devices": Raw(up.VLLM_RUNNING.name, drop=up.VLLM_LABELS),
        "kv_cache": Raw(up.VLLM_KV_CACHE.name, fallback=up.VLLM_KV_CACHE_BEFORE_0_9, drop=up.VLLM_LABELS),
    },
    notes=(
        "`tenant` is vLLM's `model_name`: one queue per served model, so a starved tenant is a stalled "
        "model (requests waiting, no token generated). Data-parallel engines (`engine`) are summed, "
        "except waiting requests and generated tokens: starvation is judged per engine, so an engine "
        "that stalls is not hidden behind one that serves (the alert carries `engine`).",
        "No kernel timing: the latency dimension of the composite is the inter-token latency "
        "(GPUStepLatencySpike), the engine's step time as requests see it, which queueing cannot raise.",
        "No memory of the serving process (vLLM preallocates GPU memory for its KV cache): the leak "
        "alerts have nothing to read, and the composite's memory dimension is the KV cache full and "
        "preempting (GPUKVCacheExhausted); the GPU role's framebuffer alerts still watch the GPU.",
        "No per-tenant GPU seconds or quotas (GPUTenantUnderServed), no batch-size histogram, no timer "
        "health, no log shipping to Loki.",
        "Availability counts `finished_reason=\"error\"` (vLLM 0.11+); requests vLLM's HTTP layer rejects "
        "before the engine are not in `vllm:request_success_total`.",
        "prometheus_client 0.26's OpenMetrics writer, which vLLM's /metrics uses when the scraper asks "
        "for OpenMetrics (Prometheus does by default), writes `vllm_...` sample names for `vllm:...` "
        "families: where your series arrive so, scrape vLLM with the text format or pin prometheus_client.",
        "`vllm:time_per_output_token_seconds` (the inter-token latency's name before 0.11) is read where "
        "`vllm:inter_token_latency_seconds` is absent, and `vllm:gpu_cache_usage_perc` where "
        "`vllm:kv_cache_usage_perc` is.",
        "TTFT is vLLM's engine-side one: arrival to the step that produced the first token, before "
        "detokenizing and the HTTP write. gpuscope serve's `gpuscope_request_ttft_seconds` is taken when "
        "the first non-empty text is written to the client, as clients measure it (its engine-side TTFT "
        "is `gpuscope_request_engine_ttft_seconds`, and is what it exposes as "
        "`vllm:time_to_first_token_seconds` under `--metrics.names vllm`): on the same load the "
        "TTFT alerts and panels read a little lower on the vllm source, by the detokenizer's hold-back "
        "and the delivery to the HTTP loop.",
    ),
)

#: dcgm-exporter's labels its normalised series aggregate away (dcgm.py says why each would break a join).
DCGM_IDENTITY = dcgm.DROP
_DCGM = {"drop": DCGM_IDENTITY, "prepare": dcgm.fold_mig}
#: NVML's clock event (throttle) reason bits that hold clocks back, named as gpuscope exporter names them.
DCGM_CLOCK_EVENT_BITS = (("sw_power_cap", 0x4), ("hw_slowdown", 0x8), ("sync_boost", 0x10),
                         ("sw_thermal_slowdown", 0x20), ("hw_thermal_slowdown", 0x40),
                         ("hw_power_brake_slowdown", 0x80))
DCGM_CLOCK_EVENTS = ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")


def _dcgm(name: str, **kw) -> Raw:
    return Raw(name, **{**_DCGM, **kw})


def _dcgm_clock_events(p: Profile, s: str) -> str:
    """Share of the throttle window with each reason's bit set in the bitmask gauge (either name)."""
    mask = f'max without () ({{__name__=~"{"|".join(DCGM_CLOCK_EVENTS)}",{s}}})'
    w = duration(p.windows.throttle)
    parts = [f'label_replace(avg_over_time((floor({mask} / {bit}) % 2)[{w}:]), "reason", "{reason}", "", "")'
             for reason, bit in DCGM_CLOCK_EVENT_BITS]
    return dcgm.normalised("\n  or\n  ".join(parts))


def _dcgm_xid(p: Profile, s: str) -> str:
    """A change of the GPU's last XID code to a non-zero one within the window is an XID of that code.
    Read from the stable per-GPU code (``GPU_XID_CODE``): a new per-code series (3.3.6+) or a new pod's
    series is not a change, a new code is."""
    code = sel(names.GPU_XID_CODE, s)
    window = duration(p.windows.xid)
    return f'count_values without () ("xid",\n  {code} > 0\n  unless\n  changes({code}[{window}]) == 0\n)'


DCGM_EXPORTER = Source(
    name=parts.DCGM_EXPORTER.job, role="gpu", title="NVIDIA dcgm-exporter",
    upstream="NVIDIA/dcgm-exporter etc/default-counters.csv and its Prometheus exposition, 3.3 / 4.x",
    selector_field="dcgm",
    raw={
        "gpu_memory_utilization": _dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", scale=0.01),
        "gpu_memory_used": _dcgm("DCGM_FI_DEV_FB_USED", scale=_MIB),
        "gpu_memory_total": _dcgm("DCGM_FI_DEV_FB_FREE", plus="DCGM_FI_DEV_FB_USED", scale=_MIB),
        "gpu_temperature": _dcgm("DCGM_FI_DEV_GPU_TEMP"),
        "gpu_memory_temperature": _dcgm("DCGM_FI_DEV_MEMORY_TEMP"),
        "gpu_power": _dcgm("DCGM_FI_DEV_POWER_USAGE"),
        "gpu_power_limit": _dcgm("DCGM_FI_DEV_POWER_MGMT_LIMIT"),
        "gpu_sm_clock": _dcgm("DCGM_FI_DEV_SM_CLOCK", scale=1e6),
        "gpu_memory_clock": _dcgm("DCGM_FI_DEV_MEM_CLOCK", scale=1e6),
        # A GPU time-sliced between pods is written once per pod (the same device counter each time):
        # its copies are one counter, not a sum.
        "gpu_energy": _dcgm("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", scale=0.001, combine="max"),
        "gpu_pcie_replay": _dcgm("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", combine="max"),
    },
    custom={
        # GR_ENGINE_ACTIVE is a ratio; GPU_UTIL, where the profiling fields are off, a percentage.
        "gpu_utilization": lambda p, s: dcgm.normalised(
            f"{sel('DCGM_FI_PROF_GR_ENGINE_ACTIVE', s)}\n  or\n  {sel('DCGM_FI_DEV_GPU_UTIL', s)} / 100"),
        "gpu_info": lambda p, s: dcgm.info(s),
        "exporter_gpus": lambda p, s: dcgm.gpus(s),
        "clock_event": _dcgm_clock_events,
        "xid_code": lambda p, s: dcgm.xid_code(s, p.thresholds.xid_critical),
        "xid": _dcgm_xid,
    },
    notes=(
        "Units converted to base units: framebuffer MiB → bytes (capacity = used + free), clocks MHz → "
        "Hz, energy mJ → J, utilization % → ratio; power is already in W. A GPU time-sliced between "
        "pods is written once per pod: its copies are taken once (max), never summed; while a pod is "
        "replaced the energy and PCIe replay rates read low for one rate window.",
        "Utilization is `DCGM_FI_PROF_GR_ENGINE_ACTIVE` where the profiling fields are enabled, else "
        "`DCGM_FI_DEV_GPU_UTIL`.",
        "XID: the GPU's last code (`gpuscope:gpu_xid:last_code`) is read from the last-value gauge "
        "before 3.3.6 and from the per-code series (`err_code`, `err_msg`; value the code) since, the "
        "critical codes from `err_code` whatever the value; a "
        "change to a non-zero code within the XID window counts as one XID of that code. The same code "
        "twice in a row, or two codes within one scrape, show as one; a code already there when the "
        "rules first ran is not reported.",
        "MIG: each GPU instance is its own `gpu`, `\"<gpu>/gi<GPU_I_ID>\"` (the bundle's exporter names "
        "them `\"<gpu>/gi<n>/ci<m>\"`), so every GPU alert, route and panel is per instance; "
        "`gpuscope:gpu:info` has its `mig_parent` and `mig_profile` (`GPU_I_PROFILE`).",
        "Kubernetes: normalised series drop the workload's `pod`, `namespace`, `container` (and the "
        "`exported_*` names a ServiceMonitor with `honorLabels: false` gives them, where `pod`, "
        "`namespace`, `container` are the exporter's own), so a replaced pod continues the same series "
        "and the GPUs of a target are counted once in either mode; the framebuffer records read the "
        "normalised series, so their history (and the fast alert's age guard) starts when the rules "
        "are first loaded, and a replaced pod's warm-up is not a new series.",
        "Throttling needs `DCGM_FI_DEV_CLOCK_THROTTLE_REASONS` (or its newer name "
        "`DCGM_FI_DEV_CLOCKS_EVENT_REASONS`) in the counters file; its bits are sampled at the rule "
        "evaluation interval.",
        "No NVML health of its own (GPUs answering, cached-value age, NVML errors, GPUs lost): "
        "GPULost, GPUFellOffBus and GPUExporterStale have nothing to read; GPUs missing counts the GPUs "
        "it reports.",
        "Identity labels are kept on `gpuscope:gpu:info` only (`uuid` ← `UUID`, `name` ← `modelName`), "
        "with the workload's `pod`, `namespace` and `container` in Kubernetes mode (from `exported_*` "
        "under `honorLabels: false`; none on a GPU without a workload); GPU alerts join `uuid`, `name`, "
        "`pod`, `namespace`, `container` from it.",
    ),
)

# `gpuscope share` (docs/share.md): tenants are processes sharing one GPU. The GPU seconds the controller
# charged and the target shares are the same quantities as the server's, so the tenants dashboard and
# the under-served and starved alerts read them unchanged; the backlog is a launching thread held at
# the gate at every sample of the window (a tenant that gets its turns is seen running at some sample).
# Charged, not the processes' own event time: that spans the other tenants' slices while two run at
# once (an overlapping hand-over), and a tenant beside the holder posts none outside its probes. Its own
# quantities (memory held against each tenant's cap, allocations refused at it, processes on the GPU
# that never joined, GPU time as NVML sees it) have alerts and panels of their own.
_SHARE = {"drop": ("pid",)}
GPUSCOPE_SHARE = Source(
    name=parts.SHARE.job, role="server", title="gpuscope share",
    upstream="src/gpuscope/contract/catalogue.py (this repository)", selector_field="share",
    raw={"tenant_gpu_seconds": Raw(m.SHARE_CHARGED_SECONDS.name),
         "quota": Raw(m.SHARE_TARGET_RATIO.name),
         "queue_depth": Raw(m.SHARE_WAITING_THREADS.name, **_SHARE),
         **{key: Raw(metric.name) for key, metric in {
             "tenant_memory_used": m.SHARE_MEMORY_USED, "tenant_memory_cap": m.SHARE_MEMORY_CAP,
             "tenant_memory_refused": m.SHARE_MEMORY_REFUSED,
             "tenant_nvml_busy": m.SHARE_NVML_BUSY_SECONDS, "tenant_under_reported": m.SHARE_UNDER_REPORTED,
             "unmanaged_processes": m.SHARE_UNMANAGED_PROCESSES,
             "unmanaged_memory": m.SHARE_UNMANAGED_MEMORY,
         }.items()}},
    notes=("Tenants are processes on a node's GPUs (`gpuscope share`, series per `gpu` and `uuid`): the "
           "GPU seconds the controller charged each, target shares and the backlog (threads held at the "
           "gate); no requests, tokens or latency, so a tenant held at every sample of the window counts "
           "as starved (no tokens are ever generated).",
           "Its own series: each tenant's device memory against its cap and the allocations refused at "
           "the cap (GPUTenantNearMemoryCap, GPUTenantAllocationsRefused), processes on the GPU that "
           "never joined the controller (GPUShareUnmanagedProcesses), and the tenants' GPU time as NVML "
           "sees it with the controller's under-reporting flag (GPUTenantUnderReported). The last two "
           "need NVML on the controller's host: without it they are absent and those alerts are "
           "silent.",),
)

SOURCES: dict[str, Source] = {s.name: s for s in (GPUSCOPE_SERVER, GPUSCOPE_EXPORTER, VLLM, DCGM_EXPORTER,
                                                  GPUSCOPE_SHARE)}


def selected(p: Profile) -> list[Source]:
    """The profile's sources, server role first (the order their groups are written in)."""
    unknown = set(p.sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; known: {', '.join(SOURCES)}")
    return sorted((SOURCES[n] for n in p.sources),
                  key=lambda s: (s.role != "server", p.sources.index(s.name)))


#: The server source ``gpuscope stack --stack.source`` (and the alert drill) can run: the gpuscope serve
#: flags that make it expose that source's metrics. The stack scrapes it under the job the source's
#: selector names and loads that source's layer with the GPU exporter's.
STACK_SERVER_FLAGS = {GPUSCOPE_SERVER.name: (), VLLM.name: ("--metrics.names", MetricNames.VLLM.value)}


def stack_job(name: str, p: Profile) -> str:
    """The job a source's selector picks (``job="vllm"`` → ``vllm``)."""
    match = re.fullmatch(r'job="([^"]+)"', SOURCES[name].selector(p))
    if match is None:
        raise ValueError(f"the {name} selector {SOURCES[name].selector(p)!r} names no single job")
    return match.group(1)
