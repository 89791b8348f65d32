"""The metrics other programs expose, as they expose them: vLLM's and dcgm-exporter's names, types,
labels, units and bucket layouts, written down once.

``sources.py`` normalises them, ``gpuscope serve --metrics.names vllm`` exposes its serving metrics under
vLLM's definitions, and the fixtures under ``tests/fixtures/sources/`` are checked against them. Each
block names the upstream file (and version) it follows; ``Metric`` is the catalogue's class, so
``create()`` builds the prometheus_client object exactly as vLLM does.
"""

from __future__ import annotations

from gpuscope.contract.catalogue import VLLM_ITL_BUCKETS, VLLM_REQUEST_BUCKETS, VLLM_TTFT_BUCKETS, Metric

# --- vLLM --------------------------------------------------------------------------------------------------
# vllm-project/vllm, vllm/v1/metrics/loggers.py (PrometheusStatLogger), v0.12: every series carries
# model_name (the served model) and engine (the data-parallel engine index); counters are exposed with
# _total; the finish reasons are vllm/v1/engine/__init__.py's FINISH_REASON_STRINGS.
VLLM_LABELS = ("model_name", "engine")
VLLM_AREA = "vLLM (V1 engine)"


def _vllm(name: str, type_: str, help_: str, unit: str, buckets: tuple[float, ...] | None = None,
          labels: tuple[str, ...] = VLLM_LABELS) -> Metric:
    return Metric(name, type_, help_, unit, labels, buckets, VLLM_AREA)  # type: ignore[arg-type]


VLLM_TTFT = _vllm("vllm:time_to_first_token_seconds", "histogram",
                  "Histogram of time to first token in seconds.", "seconds", VLLM_TTFT_BUCKETS)
VLLM_ITL = _vllm("vllm:inter_token_latency_seconds", "histogram",
                 "Histogram of inter-token latency in seconds.", "seconds", VLLM_ITL_BUCKETS)
#: The inter-token latency's name before vLLM 0.11 (0.11 exposes both; 0.12 only behind a flag).
VLLM_ITL_BEFORE_0_11 = "vllm:time_per_output_token_seconds"
VLLM_TPOT = _vllm("vllm:request_time_per_output_token_seconds", "histogram",
                  "Histogram of time_per_output_token_seconds per request.", "seconds", VLLM_ITL_BUCKETS)
VLLM_E2E = _vllm("vllm:e2e_request_latency_seconds", "histogram",
                 "Histogram of e2e request latency in seconds.", "seconds", VLLM_REQUEST_BUCKETS)
VLLM_QUEUE = _vllm("vllm:request_queue_time_seconds", "histogram",
                   "Histogram of time spent in WAITING phase for request.", "seconds", VLLM_REQUEST_BUCKETS)
VLLM_PREFILL = _vllm("vllm:request_prefill_time_seconds", "histogram",
                     "Histogram of time spent in PREFILL phase for request.", "seconds", VLLM_REQUEST_BUCKETS)
VLLM_DECODE = _vllm("vllm:request_decode_time_seconds", "histogram",
                    "Histogram of time spent in DECODE phase for request.", "seconds", VLLM_REQUEST_BUCKETS)
VLLM_RUNNING = _vllm("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                     "requests")
VLLM_WAITING = _vllm("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                     "requests")
VLLM_KV_CACHE = _vllm("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                      "ratio")
#: The KV cache usage's name before vLLM 0.9.
VLLM_KV_CACHE_BEFORE_0_9 = "vllm:gpu_cache_usage_perc"
VLLM_PREEMPTIONS = _vllm("vllm:num_preemptions_total", "counter",
                         "Cumulative number of preemption from the engine.", "preemptions")
VLLM_PROMPT_TOKENS = _vllm("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                           "tokens")
VLLM_GENERATION_TOKENS = _vllm("vllm:generation_tokens_total", "counter",
                               "Number of generation tokens processed.", "tokens")
VLLM_REQUEST_SUCCESS = _vllm("vllm:request_success_total", "counter",
                             "Count of successfully processed requests.", "requests",
                             labels=(*VLLM_LABELS, "finished_reason"))
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")
VLLM_METRICS = (VLLM_TTFT, VLLM_ITL, VLLM_TPOT, VLLM_E2E, VLLM_QUEUE, VLLM_PREFILL, VLLM_DECODE, VLLM_RUNNING,
                VLLM_WAITING, VLLM_KV_CACHE, VLLM_PREEMPTIONS, VLLM_PROMPT_TOKENS, VLLM_GENERATION_TOKENS,
                VLLM_REQUEST_SUCCESS)

# --- dcgm-exporter ----------------------------------------------------------------------------------------
# NVIDIA/dcgm-exporter, etc/default-counters.csv (3.3 / 4.x) and the fields it documents as optional
# (profiling, clock events): all gauges except the counters marked so, in DCGM's units. Labels: gpu,
# UUID, pci_bus_id, device, modelName, Hostname, the driver version field, and pod, namespace and
# container in Kubernetes mode (internal/pkg/transformation/kubernetes.go; empty on a GPU without a
# workload). With MIG, each GPU instance is its own entity with its parent's gpu and UUID plus
# GPU_I_PROFILE and GPU_I_ID (internal/pkg/collector/gpu_collector.go: MigProfile, GPUInstanceID).
# Since 3.3.6 DCGM_FI_DEV_XID_ERRORS carries err_code and err_msg, its value still the code
# (gpu_collector.go, toMetric), so each code is a series of its own.
DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
DCGM_KUBERNETES_LABELS = ("container", "namespace", "pod")
DCGM_MIG_LABELS = ("GPU_I_PROFILE", "GPU_I_ID")
DCGM_XID_LABELS = ("err_code", "err_msg")
DCGM = {
    # name: (type, unit as DCGM reports it)
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "MHz"),
    "DCGM_FI_DEV_MEM_CLOCK": ("gauge", "MHz"),
    "DCGM_FI_DEV_MEMORY_TEMP": ("gauge", "C"),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "C"),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "W"),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("counter", "mJ"),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("counter", "retries"),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "%"),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gauge", "%"),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "last XID code"),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "MiB"),
    "DCGM_FI_DEV_FB_USED": ("gauge", "MiB"),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("gauge", "ratio"),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("gauge", "bitmask"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("gauge", "bitmask"),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("gauge", "W"),
}
