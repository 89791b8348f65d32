"""Names of the recording rules, for dashboards and other rules to import (never retype them).

Names follow ``gpuscope:<what>:<aggregation>``, where ``<what>`` is the catalogue metric without its
``gpuscope_`` prefix. Window lengths are not in the names: the test profile records the same series
over compressed windows. Labels kept by each rule are listed next to it. A gauge's name ends in how
a source's splits of it are combined (``AGGREGATIONS``, the one statement of it), or in what its value
is where that says more: ``info`` (1 per label set) or ``count`` (a number of things).

Two layers (docs/sources.md):

- **normalised series**, recorded by each source's layer (``gpuscope.alerting.sources``) from that
  source's own metrics: the first aggregation every consumer reads (bucket rates, counter rates,
  gauges, memory floors, SLO windows). Every alert, the composite, the SLO burn rates, the bottleneck
  classes and every dashboard panel read only these and the derived series below; none names a
  source's metric. Each keeps its source's target labels (``job``, ``instance``, and whatever the
  scrape configuration adds), plus the canonical labels listed.
- **derived series**, recorded once for every source from the normalised ones (quantiles, baselines,
  burn rates, shares, degradation dimensions, bottleneck classes).
"""

from __future__ import annotations

from gpuscope.contract import catalogue as m


def _base(metric: m.Metric) -> str:
    return metric.name.removeprefix("gpuscope_").removesuffix("_total")


def rate(metric: m.Metric, suffix: str = "") -> str:
    """``gpuscope:<metric><suffix>:rate``: per-second rate of a counter (or a histogram's series)."""
    return f"gpuscope:{_base(metric)}{suffix}:rate"


#: How each normalised gauge combines the series a source splits it into, by record name: the PromQL
#: aggregation over the source's labels the canonical series does not keep (``sum``, ``max``, ``min``;
#: ``group`` for identity series, whose value is 1 whatever the source's). The normalisation layer
#: (``gpuscope.alerting.sources``) and ``gpuscope diagnose`` read it here; ``gauge`` fills it in.
AGGREGATIONS: dict[str, str] = {}


def _gauge(name: str, aggregation: str) -> str:
    AGGREGATIONS[name] = aggregation
    return name


def gauge(metric: m.Metric, aggregation: str, kind: str = "") -> str:
    """``gpuscope:<metric>:<aggregation>``: a gauge, combined with ``aggregation`` over what a source
    splits it by; named ``gpuscope:<metric>:<kind>`` where ``kind`` says what the value is instead."""
    return _gauge(f"gpuscope:{_base(metric)}:{kind or aggregation}", aggregation)


#: What a latency histogram's recording rules record (latency.py), the last part of their names.
P50, P99, SAMPLES_RATE = "p50", "p99", "samples_rate"
P50_BASELINE, P99_BASELINE = "p50_baseline", "p99_baseline"
QUANTILE_SUFFIXES = (P50, P99, P50_BASELINE, P99_BASELINE, SAMPLES_RATE)


def quantile(metric: m.Metric, q: str) -> str:
    """``gpuscope:<histogram>:<q>``, q one of QUANTILE_SUFFIXES."""
    return f"gpuscope:{_base(metric)}:{q}"


# === Normalised series (recorded by each source's layer) ==============================================

# --- server role: latency histograms, as bucket and count rates over the latency window ----------------
# (sum rates only where a panel shows a mean)
#: {op, device}
REGION_BUCKET_RATE = rate(m.REGION_GPU_SECONDS, "_bucket")
REGION_COUNT_RATE = rate(m.REGION_GPU_SECONDS, "_count")
REGION_SUM_RATE = rate(m.REGION_GPU_SECONDS, "_sum")
#: {tenant}: a gpuscope tenant, or vLLM's model_name (vLLM has one queue per served model).
TTFT_BUCKET_RATE = rate(m.REQUEST_TTFT, "_bucket")
TTFT_COUNT_RATE = rate(m.REQUEST_TTFT, "_count")
ITL_BUCKET_RATE = rate(m.REQUEST_ITL, "_bucket")
ITL_COUNT_RATE = rate(m.REQUEST_ITL, "_count")
TPOT_BUCKET_RATE = rate(m.REQUEST_TPOT, "_bucket")
TPOT_COUNT_RATE = rate(m.REQUEST_TPOT, "_count")
E2E_BUCKET_RATE = rate(m.REQUEST_E2E, "_bucket")
E2E_COUNT_RATE = rate(m.REQUEST_E2E, "_count")
QUEUE_BUCKET_RATE = rate(m.REQUEST_QUEUE, "_bucket")
QUEUE_COUNT_RATE = rate(m.REQUEST_QUEUE, "_count")
PREFILL_BUCKET_RATE = rate(m.REQUEST_PREFILL, "_bucket")
PREFILL_COUNT_RATE = rate(m.REQUEST_PREFILL, "_count")
DECODE_BUCKET_RATE = rate(m.REQUEST_DECODE, "_bucket")
DECODE_COUNT_RATE = rate(m.REQUEST_DECODE, "_count")
#: {phase}
BATCH_SIZE_BUCKET_RATE = rate(m.BATCH_SIZE, "_bucket")
BATCH_SIZE_COUNT_RATE = rate(m.BATCH_SIZE, "_count")
BATCH_SIZE_SUM_RATE = rate(m.BATCH_SIZE, "_sum")

# --- server role: counters, as rates (window in brackets) --------------------------------------------
#: {tenant, outcome} [latency]; outcome is stop, length, abort, error or rejected.
REQUESTS_RATE = rate(m.REQUESTS)
#: {tenant} [latency]
PROMPT_TOKENS_RATE = rate(m.PROMPT_TOKENS)
#: {tenant} [starvation]: the starvation alert's "no progress".
GENERATION_TOKENS_RATE = rate(m.GENERATION_TOKENS)
#: {tenant} [latency]
PREEMPTIONS_RATE = rate(m.PREEMPTIONS)
#: {tenant} [starvation]
TENANT_GPU_SECONDS_RATE = rate(m.TENANT_GPU_SECONDS)
#: {op} [latency]
REGIONS_ENTERED_RATE = rate(m.REGIONS_ENTERED)
#: {reason} [timer_drop]
TIMER_DROPPED_RATE = rate(m.TIMER_DROPPED)
#: Timed regions per second [timer_drop]: what the drop ratio divides by.
TIMER_TIMED_RATE = "gpuscope:timer_timed_samples:rate"
#: {reason} [latency]
LOG_RECORDS_DROPPED_RATE = rate(m.LOG_RECORDS_DROPPED)

# --- server role: gauges ---------------------------------------------------------------------------------
#: {tenant}
QUEUE_DEPTH = gauge(m.QUEUE_DEPTH, "sum")
REQUESTS_RUNNING = gauge(m.REQUESTS_RUNNING, "sum")
TENANT_SHARE_QUOTA = gauge(m.TENANT_SHARE_QUOTA, "max")
#: Lowest queue depth over the starvation window: above 0, the tenant's queue never emptied. A source's
#: splits of it are combined as the queue depth's. {tenant}
TENANT_BACKLOG = f"gpuscope:{_base(m.QUEUE_DEPTH)}:min"
KV_CACHE_USAGE = gauge(m.KV_CACHE_USAGE, "max")
#: {device}
DEVICE_MEMORY_ALLOCATED = gauge(m.DEVICE_MEMORY_ALLOCATED, "sum")
DEVICE_MEMORY_RESERVED = gauge(m.DEVICE_MEMORY_RESERVED, "sum")
DEVICE_MEMORY_TOTAL = gauge(m.DEVICE_MEMORY_TOTAL, "sum")
#: Value 1 per device the server runs on ({device}); a server without devices is one device-less unit.
SERVER_DEVICE = _gauge("gpuscope:server_device:info", "group")
#: The server's scrape health (Prometheus' ``up`` of the source's targets).
SERVER_UP = "gpuscope:server:up"
#: Value 1 with the source's job label while it has no target at all (``absent(up{...})``).
SERVER_TARGETS_ABSENT = "gpuscope:server_targets:absent"
#: Timer health (gpuscope only). {op}
TIMER_SAMPLING_RATIO = gauge(m.TIMER_SAMPLING_RATIO, "max")
TIMER_HOT_PATH = gauge(m.TIMER_HOT_PATH_SECONDS, "max")
TIMER_OVERHEAD = gauge(m.TIMER_OVERHEAD_RATIO, "max")
TIMER_OVERHEAD_BUDGET = gauge(m.TIMER_OVERHEAD_BUDGET_RATIO, "max")
#: {device}
TIMER_BASELINE = gauge(m.TIMER_BASELINE_SECONDS, "max")
TIMER_RESOLVER_LAG = gauge(m.TIMER_RESOLVER_LAG_SECONDS, "max")
TIMER_PENDING = gauge(m.TIMER_PENDING, "sum")
#: Value 1 per route the timer records events through. {backend}
TIMER_BACKEND = gauge(m.TIMER_BACKEND, "max", kind="info")
#: Share of an op's region time its kernels keep the GPU busy (kernel busy windows). {op, device}
REGION_GPU_BUSY_RATIO = gauge(m.REGION_GPU_BUSY_RATIO, "max")
LOG_QUEUE_RECORDS = gauge(m.LOG_QUEUE_RECORDS, "sum")

# --- GPU role (per GPU: {gpu}) --------------------------------------------------------------------------
#: Value 1; {gpu, uuid, name} (and pod, namespace, container where dcgm-exporter maps GPUs to pods).
GPU_INFO = _gauge("gpuscope:gpu:info", "group")
GPU_UTILIZATION = gauge(m.GPU_UTILIZATION, "max")
GPU_MEMORY_UTILIZATION = gauge(m.GPU_MEMORY_UTILIZATION, "max")
GPU_MEMORY_USED = gauge(m.GPU_MEMORY_USED, "max")
GPU_MEMORY_TOTAL = gauge(m.GPU_MEMORY_TOTAL, "max")
GPU_TEMPERATURE = gauge(m.GPU_TEMPERATURE, "max")
GPU_MEMORY_TEMPERATURE = gauge(m.GPU_MEMORY_TEMPERATURE, "max")
GPU_POWER = gauge(m.GPU_POWER, "max")
GPU_POWER_LIMIT = gauge(m.GPU_POWER_LIMIT, "max")
GPU_SM_CLOCK = gauge(m.GPU_SM_CLOCK, "max")
GPU_MEMORY_CLOCK = gauge(m.GPU_MEMORY_CLOCK, "max")
GPU_PSTATE = gauge(m.GPU_PSTATE, "max")
#: [latency] watts averaged from the energy counter
GPU_ENERGY_RATE = rate(m.GPU_ENERGY)
#: {type} [latency]
GPU_ECC_ERRORS_RATE = rate(m.GPU_ECC_ERRORS)
#: [latency]
GPU_PCIE_REPLAY_RATE = rate(m.GPU_PCIE_REPLAY)
#: Share of the throttle window with each clock event (throttle) reason active. {gpu, reason}
GPU_CLOCK_EVENT_RATIO = f"gpuscope:{_base(m.GPU_CLOCK_EVENT_ACTIVE)}:ratio"
#: Value 1 while an XID of that code was reported within the XID window. {gpu, xid}
GPU_XID_RECENT = "gpuscope:gpu_xid:recent"
#: The last XID code a GPU reported (0: none), where the source keeps only the last one (dcgm-exporter).
GPU_XID_CODE = "gpuscope:gpu_xid:last_code"
#: GPUs the exporter sees (no gpu label).
EXPORTER_GPUS = gauge(m.EXPORTER_GPUS, "sum", kind="count")
EXPORTER_GPU_UP = gauge(m.EXPORTER_GPU_UP, "min")
#: GPUs NVML reported lost over the XID window.
EXPORTER_GPUS_LOST = "gpuscope:exporter_gpus_lost:increase"
#: {collector}
EXPORTER_STALENESS = gauge(m.EXPORTER_STALENESS, "max")
EXPORTER_COLLECTION_SECONDS = gauge(m.EXPORTER_COLLECTION_SECONDS, "max")
#: {call} [latency]
EXPORTER_ERRORS_RATE = rate(m.EXPORTER_ERRORS)
#: NVML initialisation failures since the exporter started (the GPUs-missing alert prints it).
EXPORTER_INIT_ERRORS = _gauge("gpuscope:exporter_init_errors:count", "sum")
GPU_EXPORTER_UP = "gpuscope:gpu_exporter:up"
GPU_EXPORTER_TARGETS_ABSENT = "gpuscope:gpu_exporter_targets:absent"

# --- processes sharing one GPU (gpuscope share): per tenant {tenant}, and per controller ---------------
#: Device memory a tenant's processes hold together, and its cap (absent for a tenant without one). {tenant}
TENANT_MEMORY_USED = gauge(m.SHARE_MEMORY_USED, "sum")
TENANT_MEMORY_CAP = gauge(m.SHARE_MEMORY_CAP, "max")
#: Allocations refused at the tenant's cap (its processes got CUDA out-of-memory), per second.
#: {tenant} [latency]
TENANT_MEMORY_REFUSED_RATE = rate(m.SHARE_MEMORY_REFUSED)
#: GPU seconds per second NVML saw the tenant's processes busy, whatever they report. {tenant} [starvation]
TENANT_NVML_BUSY_RATE = rate(m.SHARE_NVML_BUSY_SECONDS)
#: 1 while the controller flags the tenant as under-reporting its GPU time (NVML saw more). {tenant}
TENANT_UNDER_REPORTED = gauge(m.SHARE_UNDER_REPORTED, "max")
#: Processes on the controller's GPU that never joined it, and the device memory they hold (no tenant).
UNMANAGED_PROCESSES = gauge(m.SHARE_UNMANAGED_PROCESSES, "sum")
UNMANAGED_MEMORY = gauge(m.SHARE_UNMANAGED_MEMORY, "sum")

# --- memory floors (memory.py): the server's memory {device} and each GPU's framebuffer {gpu} -------------
# Growth of the floor in bytes per second. The slow one is the slowest growth of the floor over any
# interval of the leak span, present only with enough history and growth that is not fading.
MEMORY_GROWTH_RATE = f"gpuscope:{_base(m.DEVICE_MEMORY_ALLOCATED)}:floor_growth_rate"
MEMORY_GROWTH_RATE_FAST = f"gpuscope:{_base(m.DEVICE_MEMORY_ALLOCATED)}:floor_growth_rate_fast"
GPU_MEMORY_GROWTH_RATE = f"gpuscope:{_base(m.GPU_MEMORY_USED)}:floor_growth_rate"
GPU_MEMORY_GROWTH_RATE_FAST = f"gpuscope:{_base(m.GPU_MEMORY_USED)}:floor_growth_rate_fast"
# Bytes left: capacity minus the highest value over the floor window (where a sawtooth's next peak
# would hit capacity). The fast one is present only for series older than a warm-up.
MEMORY_HEADROOM = f"gpuscope:{_base(m.DEVICE_MEMORY_ALLOCATED)}:headroom"
MEMORY_HEADROOM_FAST = f"gpuscope:{_base(m.DEVICE_MEMORY_ALLOCATED)}:headroom_fast"
GPU_MEMORY_HEADROOM = f"gpuscope:{_base(m.GPU_MEMORY_USED)}:headroom"
GPU_MEMORY_HEADROOM_FAST = f"gpuscope:{_base(m.GPU_MEMORY_USED)}:headroom_fast"

# --- SLO inputs: requests per second per window (label ``window``, e.g. "1h"), summed per job ------------
SLO_TTFT_GOOD = "gpuscope:slo_ttft:good_rate"
SLO_TTFT_TOTAL = "gpuscope:slo_ttft:total_rate"
SLO_AVAILABILITY_BAD = "gpuscope:slo_availability:bad_rate"
SLO_AVAILABILITY_TOTAL = "gpuscope:slo_availability:total_rate"

# === Derived series (recorded once, from the normalised ones) ============================================

# Latency quantiles over the latency window (NaN-free: absent while there is no traffic); latency.py
# records them with ``quantile(metric, ...)``, and every recorded name is one of these constants (a
# test keeps this module naming every recording rule).
#: {job, instance, op, device}
REGION_P50 = quantile(m.REGION_GPU_SECONDS, P50)
REGION_P99 = quantile(m.REGION_GPU_SECONDS, P99)
#: Median of the recorded p99 over the baseline window: what "normal" is for this op.
REGION_P99_BASELINE = quantile(m.REGION_GPU_SECONDS, P99_BASELINE)
#: Timed regions per second.
REGION_SAMPLES_RATE = quantile(m.REGION_GPU_SECONDS, SAMPLES_RATE)
#: {job, instance} (all tenants together: the endpoint's latency)
TTFT_P50 = quantile(m.REQUEST_TTFT, P50)
TTFT_P99 = quantile(m.REQUEST_TTFT, P99)
TTFT_P99_BASELINE = quantile(m.REQUEST_TTFT, P99_BASELINE)
TTFT_SAMPLES_RATE = quantile(m.REQUEST_TTFT, SAMPLES_RATE)
E2E_P50 = quantile(m.REQUEST_E2E, P50)
E2E_P99 = quantile(m.REQUEST_E2E, P99)
E2E_P99_BASELINE = quantile(m.REQUEST_E2E, P99_BASELINE)
E2E_SAMPLES_RATE = quantile(m.REQUEST_E2E, SAMPLES_RATE)
ITL_P50 = quantile(m.REQUEST_ITL, P50)
ITL_P99 = quantile(m.REQUEST_ITL, P99)
#: The step-latency dimension of servers without kernel timing (vLLM) compares the median with this:
#: the median of the recorded p50 over the baseline window.
ITL_P50_BASELINE = quantile(m.REQUEST_ITL, P50_BASELINE)
ITL_SAMPLES_RATE = quantile(m.REQUEST_ITL, SAMPLES_RATE)
#: {job, instance, tenant}
QUEUE_P50 = quantile(m.REQUEST_QUEUE, P50)
QUEUE_P99 = quantile(m.REQUEST_QUEUE, P99)
QUEUE_P99_BASELINE = quantile(m.REQUEST_QUEUE, P99_BASELINE)
QUEUE_SAMPLES_RATE = quantile(m.REQUEST_QUEUE, SAMPLES_RATE)

# SLO burn rates: bad fraction / error budget; label ``window`` holds the window (e.g. "1h").
#: {job, window}
SLO_TTFT_BURN_RATE = "gpuscope:slo_ttft:burn_rate"
SLO_AVAILABILITY_BURN_RATE = "gpuscope:slo_availability:burn_rate"

#: Share of the instance's tenant GPU time each tenant got over the starvation window. {job, instance, tenant}
TENANT_GPU_SHARE = f"gpuscope:{_base(m.TENANT_GPU_SECONDS)}:share"

#: 1 while a degradation dimension holds on a server instance, else 0; label ``dimension`` is a key
#: of ``composite.COMPONENTS``. {job, instance, dimension}. For dashboards; the composite reads the
#: per-device one.
DEGRADATION = "gpuscope:degradation:active"
#: 1 while a dimension holds on one device of a server instance (absent otherwise); starvation, a
#: property of the instance's queues, is recorded on every device of the instance.
#: {job, instance, device, dimension}. GPUServiceDegraded fires when two are 1 on the same device.
DEGRADATION_DEVICE = "gpuscope:degradation:device_active"

# Bottleneck classification, per host. {instance, host} where instance is the node_exporter's.
#: Busiest CPU core (1 − idle share), GPU utilization (0 on hosts without GPUs), fullest memory
#: (host RAM or any GPU's framebuffer; the two are also recorded on their own).
HOST_CPU_BUSY = "gpuscope:host_cpu_busy:ratio"
HOST_GPU_BUSY = "gpuscope:host_gpu_busy:ratio"
HOST_RAM_USED = "gpuscope:host_ram_used:ratio"
HOST_GPU_MEMORY_USED = "gpuscope:host_gpu_memory_used:ratio"
HOST_MEMORY_USED = "gpuscope:host_memory_used:ratio"
#: Value 1, label ``class`` one of the classes of ``bottleneck.py``: exactly one class per host.
BOTTLENECK_CLASS = "gpuscope:bottleneck:class"
#: The busy ratio of ops whose kernels keep the GPU busy less than ``launch_bound_busy_ratio`` of
#: their region time: modules that mostly wait for the CPU to launch them. {op, device}
OP_LAUNCH_BOUND = "gpuscope:op_launch_bound:ratio"

# Energy and cost per output token (energy.py). Keyed by ``host`` as the bottleneck series are.
#: Watts of the host's GPUs from their energy counters. {host}
HOST_GPU_POWER = "gpuscope:host_gpu_energy_joules:rate"
#: GPUs the host's GPU exporter reports. {host}
HOST_GPUS = "gpuscope:host_gpus:count"
#: Output tokens per second of each server, and its share of its host's. {host, job, instance}
SERVER_OUTPUT_TOKENS_RATE = "gpuscope:server_generation_tokens:rate"
SERVER_OUTPUT_TOKENS_HOST_SHARE = "gpuscope:server_generation_tokens:host_share"
#: The host's GPU watts attributed to each server (split by output tokens). {host, job, instance}
SERVER_GPU_POWER = "gpuscope:server_gpu_energy_joules:rate"
#: Joules per output token, and the cost of a million output tokens (cost.gpu_hour). {host, job, instance}
ENERGY_PER_OUTPUT_TOKEN = "gpuscope:energy_per_output_token:joules"
COST_PER_MILLION_OUTPUT_TOKENS = "gpuscope:cost_per_million_output_tokens:price"
#: The server's watts split by the tenants' GPU-seconds shares, J/token and cost.
#: {host, job, instance, tenant}
TENANT_GPU_POWER = "gpuscope:tenant_gpu_energy_joules:rate"
TENANT_ENERGY_PER_OUTPUT_TOKEN = "gpuscope:tenant_energy_per_output_token:joules"
TENANT_COST_PER_MILLION_OUTPUT_TOKENS = "gpuscope:tenant_cost_per_million_output_tokens:price"

# === Custom metrics (Kubernetes' custom metrics API; prometheus-adapter serves them to the server's HPA) ===


def custom_quantile(metric: m.Metric, q: float) -> str:
    """``<histogram>_p<100 q>``: a histogram's q-quantile per Kubernetes object, evaluated by the adapter
    from the source's buckets (``gpuscope_request_ttft_seconds_p95``)."""
    return f"{metric.name}_p{q * 100:g}".replace(".", "_")


#: Per server pod, its busiest GPU's utilization averaged over a window (``HOST_GPU_BUSY`` per pod).
POD_GPU_BUSY = "gpuscope_gpu_busy_ratio"

#: Per role, the up copy and the absence record of its targets (health alerts, sources).
TARGETS = {"server": (SERVER_UP, SERVER_TARGETS_ABSENT),
           "gpu": (GPU_EXPORTER_UP, GPU_EXPORTER_TARGETS_ABSENT)}
