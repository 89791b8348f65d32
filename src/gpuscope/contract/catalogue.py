"""Every gpuscope metric, defined once.

The exporter, the server, the timer, the dashboards and the alert rules all take
metric names from here; ``docs/metrics.md`` is generated from this module
(``gpuscope generate``) and a test keeps it current.

Naming rules (docs/design.md): prefix ``gpuscope_``, base units in the name, bounded
label sets. Counter names carry ``_total`` here, as they appear on ``/metrics``.
Request-latency histograms reuse vLLM's bucket layouts where the quantity is the
same, so existing dashboards and habits carry over.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

MetricType = Literal["counter", "gauge", "histogram", "info"]

# --- bucket layouts -----------------------------------------------------------

#: GPU time of a timed region: 1 µs to 10 s, 1-2.5-5 per decade (heatmap rows).
REGION_SECONDS_BUCKETS = (*(round(m * 10.0**e, 12) for e in range(-6, 1) for m in (1.0, 2.5, 5.0)), 10.0)

#: vLLM's time-to-first-token buckets.
#: Event-loop lag and engine-to-loop delivery: sub-millisecond when idle, tens of ms when the GIL is busy.
LOOP_LAG_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
#: vLLM's inter-token latency / time-per-output-token buckets.
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
#: vLLM's request latency / queue / prefill / decode buckets.
VLLM_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
#: Queue wait: vLLM's layout with the sub-300 ms buckets its users ask for (vLLM PR #39918).
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, *VLLM_REQUEST_BUCKETS)
#: Requests per batch.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Metric:
    """One metric as it appears on ``/metrics``."""

    name: str
    type: MetricType
    help: str
    unit: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    area: str = ""

    @property
    def base_name(self) -> str:
        """Name without ``_total`` (what prometheus_client constructors take for counters)."""
        if self.type == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        if self.type == "info" and self.name.endswith("_info"):
            return self.name[: -len("_info")]
        return self.name

    def series(self, suffix: str = "") -> str:
        """Name of one exposed series, e.g. ``series("_bucket")`` for a histogram."""
        return self.name + suffix

    def create(self, registry: CollectorRegistry | None, extra_labels: Sequence[str] = ()):
        """Build the prometheus_client object for direct instrumentation."""
        labels = (*self.labels, *extra_labels)
        kw = {"registry": registry} if registry is not None else {}
        if self.type == "counter":
            return Counter(self.base_name, self.help, labels, **kw)
        if self.type == "gauge":
            return Gauge(self.base_name, self.help, labels, **kw)
        if self.type == "histogram":
            return Histogram(self.base_name, self.help, labels, buckets=self.buckets, **kw)
        return Info(self.base_name, self.help, labels, **kw)

    def family(self, extra_labels: Sequence[str] = ()):
        """Build an empty metric family for a custom collector's ``collect()``."""
        labels = [*self.labels, *extra_labels]
        if self.type == "counter":
            return CounterMetricFamily(self.base_name, self.help, labels=labels)
        if self.type == "gauge":
            return GaugeMetricFamily(self.name, self.help, labels=labels)
        if self.type == "histogram":
            return HistogramMetricFamily(self.name, self.help, labels=labels)
        return InfoMetricFamily(self.base_name, self.help, labels=labels)


_CATALOGUE: dict[str, Metric] = {}


def _m(name: str, type: MetricType, help: str, unit: str, labels: Sequence[str] = (),
       buckets: Sequence[float] | None = None, *, area: str) -> Metric:
    if name in _CATALOGUE:
        raise ValueError(f"metric {name} defined twice")
    metric = Metric(name, type, help, unit, tuple(labels), tuple(buckets) if buckets else None, area)
    _CATALOGUE[name] = metric
    return metric


# --- kernel timer (gpuscope.timing) --------------------------------------------
TIMING = "Kernel timer (`gpuscope.timing`)"
REGION_GPU_SECONDS = _m(
    "gpuscope_region_gpu_seconds", "histogram",
    "GPU time of a timed region (CUDA event pair, calibrated baseline subtracted); sampled.",
    "seconds", ("op", "device"), REGION_SECONDS_BUCKETS, area=TIMING)
REGIONS_ENTERED = _m(
    "gpuscope_regions_entered_total", "counter",
    "Regions entered, sampled or not; divide the histogram's count by this for the sampling ratio.",
    "regions", ("op",), area=TIMING)
TIMER_DROPPED = _m(
    "gpuscope_timer_dropped_samples_total", "counter",
    "Sampled regions whose timing was lost, by reason (ring_full, pool_empty, graph_capture, error).",
    "samples", ("reason",), area=TIMING)
TIMER_SAMPLING_RATIO = _m(
    "gpuscope_timer_sampling_ratio", "gauge",
    "Share of entered regions that are timed, per op (1 = every region).",
    "ratio", ("op",), area=TIMING)
REGION_GPU_BUSY_RATIO = _m(
    "gpuscope_region_gpu_busy_ratio", "gauge",
    "Share of an op's region GPU time its own kernels kept the GPU busy, from the latest sampled "
    "CUPTI window (near 1: GPU-bound; well under 1: waiting for launches). Off unless enabled.",
    "ratio", ("op", "device"), area=TIMING)
REGION_KERNEL_SECONDS = _m(
    "gpuscope_region_kernel_seconds", "gauge",
    "GPU time of an op's own kernels per pass, from the latest sampled CUPTI window: kernels by the "
    "module that launched them (eager), or by the module captured around them in a compiled model's "
    "CUDA graph. Excludes the gaps between kernels that region time includes. Off unless enabled.",
    "seconds", ("op", "device"), area=TIMING)
TIMER_KERNEL_BUSY_WINDOWS = _m(
    "gpuscope_timer_kernel_busy_windows_total", "counter",
    "Sampled CUPTI windows of the kernel busy ratio, by outcome (ok, timeout, failed).",
    "windows", ("outcome",), area=TIMING)
TIMER_KERNEL_BUSY_COST_SECONDS = _m(
    "gpuscope_timer_kernel_busy_cost_seconds_total", "counter",
    "CPU seconds the kernel busy windows cost (traced passes beyond an ordinary sampled pass, "
    "plus reading CUPTI's records).",
    "seconds", area=TIMING)
TIMER_HOT_PATH_SECONDS = _m(
    "gpuscope_timer_hot_path_seconds", "gauge",
    "Estimated CPU cost of timing one region on the caller's thread (both event records).",
    "seconds", area=TIMING)
TIMER_OVERHEAD_RATIO = _m(
    "gpuscope_timer_overhead_ratio", "gauge",
    "Estimated share of busy time the timer spent on callers' threads and its resolver, last second.",
    "ratio", area=TIMING)
TIMER_OVERHEAD_BUDGET_RATIO = _m(
    "gpuscope_timer_overhead_budget_ratio", "gauge",
    "Configured overhead budget (share of busy time); 0 when a fixed sampling rate is used.",
    "ratio", area=TIMING)
TIMER_BASELINE_SECONDS = _m(
    "gpuscope_timer_baseline_seconds", "gauge",
    "Calibrated elapsed time of an empty event pair on a busy queue, subtracted from every sample.",
    "seconds", ("device",), area=TIMING)
TIMER_RESOLVER_LAG_SECONDS = _m(
    "gpuscope_timer_resolver_lag_seconds", "gauge",
    "Age of the oldest sample still waiting for its GPU work to finish.",
    "seconds", area=TIMING)
TIMER_PENDING = _m(
    "gpuscope_timer_pending_samples", "gauge",
    "Samples recorded but not yet resolved (ring occupancy).",
    "samples", area=TIMING)
TIMER_BACKEND = _m(
    "gpuscope_timer_backend_info", "info",
    "Which event-record route the timer uses (cudart-ctypes, cuda-bindings, torch, host).",
    "", area=TIMING)

# --- NVML node exporter (gpuscope exporter) ------------------------------------
GPU = "GPU node exporter (`gpuscope exporter`)"
_G = ("gpu",)
GPU_INFO = _m("gpuscope_gpu_info", "info",
              "Identity of each GPU (uuid, name, PCI bus id, driver, MIG parent); join on `gpu`.",
              "", ("gpu", "uuid", "name", "pci_bus_id", "driver_version", "mig_parent"), area=GPU)
GPU_UTILIZATION = _m("gpuscope_gpu_utilization_ratio", "gauge",
                     "Share of the last sample period in which a kernel ran (NVML utilization.gpu).",
                     "ratio", _G, area=GPU)
GPU_MEMORY_UTILIZATION = _m("gpuscope_gpu_memory_utilization_ratio", "gauge",
                            "Share of the last sample period in which device memory was read or written.",
                            "ratio", _G, area=GPU)
GPU_MEMORY_USED = _m("gpuscope_gpu_memory_used_bytes", "gauge", "Framebuffer memory in use.",
                     "bytes", _G, area=GPU)
GPU_MEMORY_FREE = _m("gpuscope_gpu_memory_free_bytes", "gauge", "Framebuffer memory free.",
                     "bytes", _G, area=GPU)
GPU_MEMORY_RESERVED = _m("gpuscope_gpu_memory_reserved_bytes", "gauge",
                         "Framebuffer memory reserved by the driver.", "bytes", _G, area=GPU)
GPU_MEMORY_TOTAL = _m("gpuscope_gpu_memory_total_bytes", "gauge", "Framebuffer memory in all.",
                      "bytes", _G, area=GPU)
GPU_SM_CLOCK = _m("gpuscope_gpu_sm_clock_hertz", "gauge", "SM clock.", "hertz", _G, area=GPU)
GPU_MEMORY_CLOCK = _m("gpuscope_gpu_memory_clock_hertz", "gauge", "Memory clock.", "hertz", _G, area=GPU)
GPU_TEMPERATURE = _m("gpuscope_gpu_temperature_celsius", "gauge", "GPU die temperature.",
                     "celsius", _G, area=GPU)
GPU_MEMORY_TEMPERATURE = _m("gpuscope_gpu_memory_temperature_celsius", "gauge",
                            "HBM temperature, where NVML reports it.", "celsius", _G, area=GPU)
GPU_POWER = _m("gpuscope_gpu_power_watts", "gauge", "Power draw.", "watts", _G, area=GPU)
GPU_POWER_LIMIT = _m("gpuscope_gpu_power_limit_watts", "gauge", "Enforced power limit.",
                     "watts", _G, area=GPU)
GPU_ENERGY = _m("gpuscope_gpu_energy_joules_total", "counter",
                "Energy consumed since the driver loaded.", "joules", _G, area=GPU)
GPU_PSTATE = _m("gpuscope_gpu_performance_state", "gauge",
                "Performance state (0 = P0, fastest; 15 = P15, slowest).", "state", _G, area=GPU)
GPU_PCIE_REPLAY = _m("gpuscope_gpu_pcie_replay_total", "counter", "PCIe replay counter.",
                     "replays", _G, area=GPU)
GPU_PCIE_THROUGHPUT = _m("gpuscope_gpu_pcie_throughput_bytes_per_second", "gauge",
                         "PCIe throughput sampled by NVML over 20 ms, by direction (tx, rx); opt-in.",
                         "bytes_per_second", ("gpu", "direction"), area=GPU)
GPU_ECC_ERRORS = _m("gpuscope_gpu_ecc_errors_total", "counter",
                    "ECC errors since the driver loaded, by type (corrected, uncorrected).",
                    "errors", ("gpu", "type"), area=GPU)
GPU_REMAPPED_ROWS = _m("gpuscope_gpu_remapped_rows", "gauge",
                       "Remapped rows by cause (correctable, uncorrectable) and pending/failed remaps.",
                       "rows", ("gpu", "cause"), area=GPU)
GPU_NVLINK_BYTES = _m("gpuscope_gpu_nvlink_bytes_total", "counter",
                      "NVLink traffic by direction (tx, rx), where NVLink is present.",
                      "bytes", ("gpu", "direction"), area=GPU)
GPU_CLOCK_EVENT_ACTIVE = _m("gpuscope_gpu_clock_event_active", "gauge",
                            "1 while a clock event (throttle) reason holds, per reason.",
                            "boolean", ("gpu", "reason"), area=GPU)
GPU_CLOCK_EVENT_SECONDS = _m("gpuscope_gpu_clock_event_seconds_total", "counter",
                             "Seconds spent with each clock event (throttle) reason active.",
                             "seconds", ("gpu", "reason"), area=GPU)
GPU_XID_ERRORS = _m("gpuscope_gpu_xid_errors_total", "counter", "XID errors by code.",
                    "errors", ("gpu", "xid"), area=GPU)
GPU_XID_LAST = _m("gpuscope_gpu_xid_last_timestamp_seconds", "gauge",
                  "Unix time of the last XID error of each code.", "seconds", ("gpu", "xid"), area=GPU)
GPU_PROCESS_MEMORY = _m("gpuscope_gpu_process_memory_bytes", "gauge",
                        "Device memory used by a process (opt-in, capped in count).",
                        "bytes", ("gpu", "pid", "process", "container_id"), area=GPU)
GPU_PROCESS_SM_UTILIZATION = _m("gpuscope_gpu_process_sm_utilization_ratio", "gauge",
                                "SM utilization of a process over the last sample window (opt-in).",
                                "ratio", ("gpu", "pid", "process", "container_id"), area=GPU)
EXPORTER_GPU_UP = _m("gpuscope_exporter_gpu_up", "gauge",
                     "1 when the GPU answered its last fast sampling round, 0 when lost or failing.",
                     "boolean", _G, area=GPU)
EXPORTER_GPUS = _m("gpuscope_exporter_gpus", "gauge", "GPUs (and MIG instances) the exporter sees.",
                   "gpus", area=GPU)
EXPORTER_GPUS_LOST = _m("gpuscope_exporter_gpus_lost_total", "counter",
                        "GPUs that fell off the bus (NVML GPU_IS_LOST).", "gpus", area=GPU)
EXPORTER_COLLECTION_SECONDS = _m("gpuscope_exporter_collection_duration_seconds", "gauge",
                                 "Duration of the last sampling round, per collector.",
                                 "seconds", ("collector",), area=GPU)
EXPORTER_LAST_SUCCESS = _m("gpuscope_exporter_last_success_timestamp_seconds", "gauge",
                           "Unix time of the last successful sampling round, per collector.",
                           "seconds", ("collector",), area=GPU)
EXPORTER_STALENESS = _m("gpuscope_exporter_staleness_seconds", "gauge",
                        "Age of the cached values served, per collector.", "seconds", ("collector",),
                        area=GPU)
EXPORTER_ERRORS = _m("gpuscope_exporter_errors_total", "counter", "Failed NVML calls, by call.",
                     "errors", ("call",), area=GPU)
EXPORTER_UNSUPPORTED = _m("gpuscope_exporter_unsupported_calls", "gauge",
                          "1 per NVML call (or field) a GPU answered NOT_SUPPORTED; it is no longer asked.",
                          "boolean", ("gpu", "call"), area=GPU)
EXPORTER_PROCESSES_OMITTED = _m("gpuscope_exporter_processes_omitted", "gauge",
                                "GPU processes left out of per-process metrics by --processes.max "
                                "(last round).",
                                "processes", _G, area=GPU)
EXPORTER_HTTP_CONNECTIONS_CLOSED = _m(
    "gpuscope_exporter_http_connections_closed_total", "counter",
    "HTTP connections the exporter closed before a request on them was answered, by reason: refused "
    "(at --web.max-connections with none waiting to evict; answered 503), evicted (the longest-waiting "
    "idle or half-sent connection, closed to admit a new one at the limit), timeout (no complete "
    "request within --web.read-timeout, idle keep-alive connections included).",
    "connections", ("reason",), area=GPU)

# --- reference inference server (gpuscope serve) -------------------------------
SERVER = "Reference inference server (`gpuscope serve`)"
_T = ("tenant",)
REQUEST_TTFT = _m("gpuscope_request_ttft_seconds", "histogram",
                  "Time to first token as the client sees it: arrival to the first non-empty text written "
                  "to the client (not streamed: to the first text ready); vLLM's buckets.",
                  "seconds", _T, VLLM_TTFT_BUCKETS, area=SERVER)
REQUEST_ENGINE_TTFT = _m("gpuscope_request_engine_ttft_seconds", "histogram",
                         "Time to first token inside the engine: arrival to the step that sampled it "
                         "(vLLM's own TTFT; before detokenizing and delivery); vLLM's buckets.",
                         "seconds", _T, VLLM_TTFT_BUCKETS, area=SERVER)
REQUEST_ITL = _m("gpuscope_request_inter_token_seconds", "histogram",
                 "Gap between consecutive output tokens of a request (vLLM's buckets).",
                 "seconds", _T, VLLM_ITL_BUCKETS, area=SERVER)
REQUEST_TPOT = _m("gpuscope_request_time_per_output_token_seconds", "histogram",
                  "(end-to-end − TTFT) / (output tokens − 1), per request (vLLM's buckets).",
                  "seconds", _T, VLLM_ITL_BUCKETS, area=SERVER)
REQUEST_E2E = _m("gpuscope_request_e2e_seconds", "histogram",
                 "Arrival to last token (vLLM's request-latency buckets).",
                 "seconds", _T, VLLM_REQUEST_BUCKETS, area=SERVER)
REQUEST_QUEUE = _m("gpuscope_request_queue_seconds", "histogram",
                   "Queued to first scheduled (vLLM's buckets with finer sub-300 ms ones).",
                   "seconds", _T, QUEUE_BUCKETS, area=SERVER)
REQUEST_PREFILL = _m("gpuscope_request_prefill_seconds", "histogram",
                     "Scheduled to first token.", "seconds", _T, VLLM_REQUEST_BUCKETS, area=SERVER)
REQUEST_DECODE = _m("gpuscope_request_decode_seconds", "histogram",
                    "First token to last token.", "seconds", _T, VLLM_REQUEST_BUCKETS, area=SERVER)
PROMPT_TOKENS = _m("gpuscope_prompt_tokens_total", "counter", "Prompt tokens processed.",
                   "tokens", _T, area=SERVER)
GENERATION_TOKENS = _m("gpuscope_generation_tokens_total", "counter", "Tokens generated.",
                       "tokens", _T, area=SERVER)
REQUESTS = _m("gpuscope_requests_total", "counter",
              "Finished requests by outcome (stop, length, abort, error, rejected).",
              "requests", ("tenant", "outcome"), area=SERVER)
REQUESTS_RUNNING = _m("gpuscope_requests_running", "gauge", "Requests in the running batch.",
                      "requests", _T, area=SERVER)
QUEUE_DEPTH = _m("gpuscope_queue_depth", "gauge", "Requests waiting to be scheduled.",
                 "requests", _T, area=SERVER)
BATCH_SIZE = _m("gpuscope_batch_size", "histogram", "Requests per model step, by phase (prefill, decode).",
                "requests", ("phase",), BATCH_SIZE_BUCKETS, area=SERVER)
KV_CACHE_USAGE = _m("gpuscope_kv_cache_usage_ratio", "gauge", "Share of KV-cache slots in use.",
                    "ratio", area=SERVER)
TENANT_GPU_SECONDS = _m("gpuscope_tenant_gpu_seconds_total", "counter",
                        "GPU time spent on each tenant's work, measured with CUDA events.",
                        "seconds", _T, area=SERVER)
TENANT_SHARE_QUOTA = _m("gpuscope_tenant_share_quota_ratio", "gauge",
                        "Configured GPU-time share of each tenant (0 in FCFS mode).",
                        "ratio", _T, area=SERVER)
DEVICE_MEMORY_ALLOCATED = _m("gpuscope_device_memory_allocated_bytes", "gauge",
                             "Memory the server holds for tensors (torch allocated bytes on CUDA; "
                             "process resident memory on CPU).", "bytes", ("device",), area=SERVER)
DEVICE_MEMORY_RESERVED = _m("gpuscope_device_memory_reserved_bytes", "gauge",
                            "Memory the server's allocator has reserved (torch reserved bytes on CUDA).",
                            "bytes", ("device",), area=SERVER)
DEVICE_MEMORY_TOTAL = _m("gpuscope_device_memory_total_bytes", "gauge",
                         "Memory the server's device has in all (torch total device memory on CUDA; the "
                         "cgroup limit or physical memory on CPU): what leak alerts predict exhaustion of.",
                         "bytes", ("device",), area=SERVER)
PREEMPTIONS = _m("gpuscope_request_preemptions_total", "counter",
                 "Running requests paused for a higher-priority tenant's request (recomputed later).",
                 "preemptions", _T, area=SERVER)
FAULT_ACTIVE = _m("gpuscope_fault_active", "gauge",
                  "1 while an injected fault is active (latency_spike, memory_leak, starvation, error_burst)",
                  "boolean", ("fault",), area=SERVER)
HTTP_CLIENT_ERRORS = _m("gpuscope_http_client_errors_total", "counter",
                        "HTTP requests that failed on the client's side, by reason: malformed (request "
                        "line or headers unparseable or over the limits; answered 400, 414 or 431), "
                        "bad_body (broken body framing or encoding; 400), disconnect (the client hung up "
                        "while its body was read or its stream written).", "requests", ("reason",),
                        area=SERVER)
HTTP_CONNECTIONS_CLOSED = _m("gpuscope_http_connections_closed_total", "counter",
                             "Connections the server closed on a slow, stalled or surplus client, by "
                             "reason: header_timeout (request line and headers not in within "
                             "--web.header-timeout; 408), body_timeout (body not in within "
                             "--web.body-timeout; 408), evicted (idle or waiting for headers, closed to "
                             "admit a new connection over --web.max-connections), refused (over the cap with "
                             "every connection answering; 503).", "connections", ("reason",), area=SERVER)
SHUTDOWN_REQUESTS = _m("gpuscope_shutdown_requests_total", "counter",
                       "Requests that ended while the server shut down (SIGTERM/SIGINT), by outcome: "
                       "rejected (arrived after the signal; 503), completed, failed, disconnected, "
                       "aborted_queued (had not started), aborted_running (still running at the end of "
                       "--shutdown.grace; error chunk and [DONE] for streams).", "requests", ("outcome",),
                       area=SERVER)
EVENT_LOOP_LAG = _m("gpuscope_event_loop_lag_seconds", "histogram",
                    "How late the HTTP event loop ran a timer due now (sampled every 25 ms): the time any "
                    "ready stream write waits, e.g. while the engine thread holds the GIL.",
                    "seconds", (), LOOP_LAG_BUCKETS, area=SERVER)
EVENT_DELIVERY = _m("gpuscope_event_delivery_seconds", "histogram",
                    "From the engine handing a step's tokens to the HTTP event loop to the loop running "
                    "them (one sample per step that produced events).",
                    "seconds", (), LOOP_LAG_BUCKETS, area=SERVER)

# --- Loki log shipping (gpuscope.logs.loki_push) -----------------------------------------
LOGS = "Loki log shipping (`gpuscope.logs.loki_push`)"
LOG_RECORDS_SENT = _m("gpuscope_log_records_sent_total", "counter", "Log records Loki accepted.",
                      "records", area=LOGS)
LOG_RECORDS_DROPPED = _m("gpuscope_log_records_dropped_total", "counter",
                         "Log records dropped, by reason (queue_full, rejected, shutdown).",
                         "records", ("reason",), area=LOGS)
LOG_PUSH_FAILURES = _m("gpuscope_log_push_failures_total", "counter",
                       "Failed pushes to Loki (each retried with backoff).", "pushes", area=LOGS)
LOG_QUEUE_RECORDS = _m("gpuscope_log_queue_records", "gauge", "Log records waiting to be pushed.",
                       "records", area=LOGS)

# --- request tracing (gpuscope serve --tracing.endpoint) -----------------------
TRACING = "Request tracing (`gpuscope serve --tracing.endpoint`)"
TRACE_SPANS_EXPORTED = _m("gpuscope_trace_spans_exported_total", "counter",
                          "Request spans the OTLP endpoint accepted.", "spans", area=TRACING)
TRACE_SPANS_DROPPED = _m("gpuscope_trace_spans_dropped_total", "counter",
                         "Request spans lost, by reason: backlog_full (finished requests waiting to become "
                         "spans were at their bound; the request's whole trace), queue_full (the export "
                         "queue had no room for the request's whole trace), export_failed (spans of an "
                         "export batch the endpoint did not accept, after the exporter's retries).",
                         "spans", ("reason",), area=TRACING)
TRACE_CONTEXT_IGNORED = _m("gpuscope_trace_context_ignored_total", "counter",
                           "Incoming W3C trace context headers ignored as invalid (traced server only), by "
                           "header: traceparent (the request starts a new trace) or tracestate (dropped).",
                           "headers", ("header",), area=TRACING)

# --- kernel profiles on demand (gpuscope serve --profile.enable) -------------------
PROFILE = "Kernel profiles (`gpuscope serve --profile.enable`)"
PROFILE_REQUESTS = _m("gpuscope_profile_requests_total", "counter",
                      "Profile capture requests to POST /admin/profile, by result: accepted, rate_limited "
                      "(within the interval after the last accepted one; 429), busy (a capture is in "
                      "progress; 409), unavailable (the asked mode cannot run here; 409).",
                      "requests", ("result",), area=PROFILE)
PROFILE_CAPTURES = _m("gpuscope_profile_captures_total", "counter",
                      "Finished profile captures, by mode (kernels: torch.profiler/CUPTI; regions: the "
                      "timer's per-op regions) and outcome (ok: every asked step; partial: fewer steps "
                      "within the window's time limit; failed: no trace written).", "captures",
                      ("mode", "outcome"), area=PROFILE)
PROFILE_THROUGHPUT_LOSS = _m("gpuscope_profile_throughput_loss_ratio", "gauge",
                             "Throughput lost while the last capture ran: 1 - (tokens per step-second "
                             "during the window) / (the same over the steps just before it). Noisy when "
                             "batch sizes changed between the two.", "ratio", area=PROFILE)
PROFILE_STALL_SECONDS = _m("gpuscope_profile_stall_seconds_total", "counter",
                           "Seconds the engine thread spent starting and stopping captures (the profiler's "
                           "own processing of what it recorded), outside any step.", "seconds",
                           area=PROFILE)
PROFILE_TRACE_BYTES = _m("gpuscope_profile_trace_bytes", "gauge",
                         "Size of the last trace file written.", "bytes", area=PROFILE)
PROFILE_EVENTS_DROPPED = _m("gpuscope_profile_events_dropped_total", "counter",
                            "Trace events left out of trace files, by reason: count_cap (over "
                            "--profile.max-events), byte_cap (over --profile.max-bytes).", "events",
                            ("reason",), area=PROFILE)
PROFILE_TRACES_RETAINED = _m("gpuscope_profile_traces_retained", "gauge",
                             "Trace files kept in --profile.dir (the oldest beyond --profile.keep are "
                             "deleted).", "files", area=PROFILE)

# --- alert receiver (gpuscope receiver) ----------------------------------------
RECEIVER = "Alert receiver (`gpuscope receiver`)"
RECEIVER_NOTIFICATIONS = _m("gpuscope_receiver_notifications_total", "counter",
                            "Alertmanager notifications received, by status (firing, resolved).",
                            "notifications", ("status",), area=RECEIVER)
RECEIVER_HTTP_CONNECTIONS_CLOSED = _m(
    "gpuscope_receiver_http_connections_closed_total", "counter",
    "HTTP connections the alert receiver closed before answering, by reason: refused (at "
    "--web.max-connections, all busy; answered 503), evicted (the longest-waiting idle or half-sent "
    "connection, closed to admit a new one), timeout (no complete request, body included, within "
    "--web.read-timeout).", "connections", ("reason",), area=RECEIVER)
RECEIVER_PROFILE_REQUESTS = _m("gpuscope_receiver_profile_requests_total", "counter",
                               "Kernel profiles the receiver asked servers for on firing latency or "
                               "composite alerts, by result: requested, rate_limited, refused (another "
                               "4xx/5xx), unreachable, not_allowed (the alert's instance is not in the "
                               "configured servers; no call made).", "requests", ("result",), area=RECEIVER)


# --- GPU-time shares between processes (gpuscope share) ------------------------
SHARE = "GPU-time shares between processes (`gpuscope share`)"
_TP = ("tenant", "pid", "gpu", "uuid")
#: Every series of one GPU's ledger carries the GPU (NVML index) and its UUID: one controller holds
#: every GPU of a node.
_G = ("gpu", "uuid")
_TG = ("tenant", *_G)
SHARE_GPU_SECONDS = _m("gpuscope_share_gpu_seconds_total", "counter",
                       "GPU time of a tenant process's launch windows, measured by CUDA events.",
                       "seconds", _TP, area=SHARE)
SHARE_CHARGED_SECONDS = _m("gpuscope_share_charged_seconds_total", "counter",
                           "GPU time the controller charged a tenant: its processes' event time, scaled "
                           "down to the wall time while tenants ran concurrently.", "seconds", _TG,
                           area=SHARE)
SHARE_THROTTLED_SECONDS = _m("gpuscope_share_throttled_seconds_total", "counter",
                             "Time the process's launching threads were held at the gate (summed over "
                             "threads).", "seconds", _TP, area=SHARE)
SHARE_SYNC_WAIT_SECONDS = _m("gpuscope_share_sync_wait_seconds_total", "counter",
                             "Time the process spent in its waits for the GPU (stream, context and event "
                             "synchronizes; summed over threads): against its probes', it tells a tenant "
                             "waiting behind another's work from one slowed on the host.", "seconds", _TP,
                             area=SHARE)
SHARE_LAUNCHES = _m("gpuscope_share_launches_total", "counter",
                    "Kernel and graph launches the preload library saw.", "launches", _TP, area=SHARE)
SHARE_BUSY_LAUNCHES = _m("gpuscope_share_busy_launches_total", "counter",
                         "Launches timed on their own (events right around the kernel) while the tenant "
                         "ran beside the slice holder.", "launches", _TP, area=SHARE)
SHARE_HOOK_ERRORS = _m("gpuscope_share_hook_errors_total", "counter",
                       "Failures inside the preload library (an event record or query that failed, no "
                       "events for accounting); the launch itself always goes ahead.", "errors", _TP,
                       area=SHARE)
SHARE_HELPER_WAKEUPS = _m("gpuscope_share_helper_wakeups_total", "counter",
                          "Wake-ups of the process's share helper thread, by what it slept on: probe (a "
                          "probe's batch posting), lock (the window lock a launching thread held), window "
                          "(a window's end event), drain (a drain's event); on the gate word nap (while the "
                          "launching thread posts its windows), watch (for a quiet holder) and gate (a plain "
                          "sleep), each woken by a gate write or its own launching thread, or run out "
                          "(nap_timeout, watch_timeout, gate_timeout).",
                          "wake-ups", ("tenant", "pid", "reason", "gpu", "uuid"), area=SHARE)
SHARE_HELPER_CPU_SECONDS = _m("gpuscope_share_helper_cpu_seconds_total", "counter",
                              "CPU time of the process's share helper thread, as of its last wake-up: what "
                              "the share costs the program besides its launches.", "seconds", _TP,
                              area=SHARE)
SHARE_FAILED_OPEN = _m("gpuscope_share_failed_open", "gauge",
                       "1 while a tenant process runs unthrottled because it lost its controller.",
                       "boolean", _TP, area=SHARE)
SHARE_WAITING_THREADS = _m("gpuscope_share_waiting_threads", "gauge",
                            "Launching threads of the process held at the gate right now (its backlog).",
                            "threads", _TP, area=SHARE)
SHARE_TARGET_RATIO = _m("gpuscope_share_target_ratio", "gauge",
                        "A tenant's target share of the GPU's time (--share).", "ratio", _TG,
                        area=SHARE)
SHARE_PROCESSES = _m("gpuscope_share_processes", "gauge", "Tenant processes attached to the controller.",
                     "processes", _TG, area=SHARE)
SHARE_SLICES = _m("gpuscope_share_slices_total", "counter",
                  "Slices of exclusive GPU access granted to a tenant while shares bind.", "slices",
                  _TG, area=SHARE)
SHARE_STATE_SECONDS = _m("gpuscope_share_state_seconds_total", "counter",
                         "Time a tenant with processes attached spent in each gate state: `open` (no share "
                         "binds), `holder` (its slice), `beside` (running next to the holder, charged per "
                         "kernel) or `held` (waiting for a turn).", "seconds", ("tenant", "state", *_G),
                         area=SHARE)
SHARE_BUSY_RATIO = _m("gpuscope_share_busy_ratio", "gauge",
                      "Busy fraction of a tenant, measured while it runs alone (a probe, one tenant at a "
                      "time): at most half decides that it runs beside the slice holder, and there it is "
                      "the share of the wall time it is charged.", "ratio",
                      _TG, area=SHARE)
SHARE_BESIDE_THROUGHPUT = _m("gpuscope_share_beside_throughput_ratio", "gauge",
                             "Throughput of a tenant beside the slice holder as a fraction of its alone "
                             "throughput, as the controller estimates it from the part of its time it waits "
                             "for the GPU there and in its probes (alone), and, where it waits more than "
                             "alone, from its launches a second there and in its probes (the lesser): what "
                             "--share.starved-below judges.",
                             "ratio", _TG, area=SHARE)
SHARE_STARVED = _m("gpuscope_share_starved_beside_total", "counter",
                   "Times a tenant beside the slice holder, with no duty holding it back, did well under its "
                   "fair share of its alone throughput (gpuscope_share_beside_throughput_ratio, under "
                   "--share.starved-below) and was moved to take turns for a while: a launch-bound loop "
                   "that waits behind a GPU-bound holder at every step.", "moves", _TG, area=SHARE)
SHARE_DUTY_RATIO = _m("gpuscope_share_duty_ratio", "gauge",
                      "Part of each 10 ms a tenant beside the slice holder may launch in: below 1 while its "
                      "busy fraction is over its share (its share over its busy fraction), 1 otherwise; "
                      "with --share.lone-holder duty, also the lone holder's (the time the tenants beside "
                      "it leave, at least its share, over its busy fraction).",
                      "ratio", _TG, area=SHARE)
SHARE_PROBES = _m("gpuscope_share_probes_total", "counter",
                  "Probes: the holder paused for --share.probe so that the tenants beside it time their "
                  "launches alone.", "probes", _G, area=SHARE)
SHARE_BINDING = _m("gpuscope_share_binding", "gauge",
                   "1 while shares bind (two or more tenants launching), 0 while the gate is open.",
                   "boolean", _G, area=SHARE)
SHARE_DRAIN_TIMEOUTS = _m("gpuscope_share_drain_timeouts_total", "counter",
                          "Hand-overs where the previous holder's queued work did not finish within "
                          "--share.drain-timeout (the next tenant was admitted anyway).", "handovers",
                          _G, area=SHARE)
SHARE_MEMORY_USED = _m("gpuscope_share_memory_used_bytes", "gauge",
                       "Device memory a tenant's processes hold together, as reserved by the preload library "
                       "before each allocation (given back at each free, and when a process ends).", "bytes",
                       _TG, area=SHARE)
SHARE_MEMORY_CAP = _m("gpuscope_share_memory_cap_bytes", "gauge",
                      "A tenant's memory cap (--share NAME=F:P:MEMORY); absent for a tenant without one, or "
                      "with a fraction of a card no process has reported yet.", "bytes", _TG,
                      area=SHARE)
SHARE_MEMORY_REFUSED = _m("gpuscope_share_memory_refused_total", "counter",
                          "Allocations refused with CUDA_ERROR_OUT_OF_MEMORY because they would take the "
                          "tenant past its memory cap.", "allocations", _TG, area=SHARE)
SHARE_UNMANAGED_PROCESSES = _m("gpuscope_share_unmanaged_processes", "gauge",
                               "Processes NVML lists on the controller's GPU that never joined it (seen in "
                               "two samples in a row): they run outside every share and memory cap.",
                               "processes", _G, area=SHARE)
SHARE_UNMANAGED_MEMORY = _m("gpuscope_share_unmanaged_memory_bytes", "gauge",
                            "Device memory held by the unmanaged processes, as NVML reports it.", "bytes",
                            _G, area=SHARE)
SHARE_NVML_BUSY_SECONDS = _m("gpuscope_share_nvml_busy_seconds_total", "counter",
                             "GPU time of a tenant's processes as NVML's per-process SM utilization shows it "
                             "(independent of what the processes report).", "seconds", _TG,
                             area=SHARE)
SHARE_UNDER_REPORTED = _m("gpuscope_share_under_reported", "gauge",
                          "1 while NVML has seen a tenant's processes busy for more than they were charged, "
                          "by over 15% of the last 5 minutes: a process may under-report its GPU time.",
                          "boolean", _TG, area=SHARE)
SHARE_POLICY_RELOADS = _m("gpuscope_share_policy_reloads_total", "counter",
                          "Changes of --share.policy-file taken (applied) or refused (the file did not "
                          "validate: the policy in force stayed).", "reloads", ("result",), area=SHARE)
SHARE_WEBHOOK_REVIEWS = _m("gpuscope_share_webhook_reviews_total", "counter",
                           "AdmissionReviews the share webhook answered, by result: mutated (an annotated "
                           "pod joined), passed (nothing to do), error (allowed unchanged: it fails open).",
                           "reviews", ("result",), area=SHARE)
SHARE_WEBHOOK_HTTP_CONNECTIONS_CLOSED = _m(
    "gpuscope_share_webhook_http_connections_closed_total", "counter",
    "HTTPS connections the share webhook closed before answering, by reason: refused (at "
    "--web.max-connections, all busy), evicted (the longest-waiting idle one), timeout (no complete "
    "request, TLS handshake included, within --web.read-timeout).", "connections", ("reason",), area=SHARE)
SHARE_JOINS = _m("gpuscope_share_joins_total", "counter",
                 "Connections to the controller's join socket, by result: joined, left (a joined process's "
                 "connection ended), unknown_tenant, not_allowed (its uid, gid or cgroup is not in "
                 "--share.allow for the tenant it named), bad_hello, timeout (no hello within 1 s, or "
                 "closed to admit a newer one), full, other_gpu (its GPU is not one the controller "
                 "holds).", "connections", ("result",), area=SHARE)
SHARE_HTTP_CONNECTIONS_CLOSED = _m(
    "gpuscope_share_http_connections_closed_total", "counter",
    "HTTP connections the share controller's /metrics server closed before answering, by reason: refused "
    "(at --web.max-connections, all busy; answered 503), evicted (the longest-waiting idle connection, "
    "closed to admit a new one), timeout (no complete request within --web.read-timeout).", "connections",
    ("reason",), area=SHARE)
SHARE_YIELDS = _m("gpuscope_share_yields_total", "counter",
                  "Draining hand-overs where the holder stopped launching at its slice's end by itself and "
                  "drained its queue before the controller looked (one controller wake-up, not two).",
                  "handovers", _G, area=SHARE)
SHARE_LENDS = _m("gpuscope_share_lent_turns_total", "counter",
                 "Turns lent while their tenant was idle (a quiet holder with nothing queued, or an idle "
                 "tenant within its share at its turn's end): the others ran in them until it launched "
                 "again.",
                 "turns", _G, area=SHARE)
SHARE_RECLAIMS = _m("gpuscope_share_reclaimed_turns_total", "counter",
                    "Lent turns taken back by their tenant's next launch, after the borrower's queued work.",
                    "turns", _G, area=SHARE)
SHARE_PRIORITY_HOLDS = _m("gpuscope_share_priority_holds_total", "counter",
                          "Bursts of launches of a tenant of higher priority beside the slice holder that "
                          "held the holder's launches until they ended (--share.priority-hold on).",
                          "holds", _G, area=SHARE)
SHARE_PRIORITY_HOLD_SECONDS = _m("gpuscope_share_priority_hold_seconds_total", "counter",
                                 "Time the slice holder's launches waited out bursts of a tenant of higher "
                                 "priority (--share.priority-hold on).",
                                 "seconds", _G, area=SHARE)

def all_metrics() -> Iterator[Metric]:
    """Every metric, in definition order."""
    return iter(_CATALOGUE.values())


def get(name: str) -> Metric:
    """The metric with this exposed name (``KeyError`` names the unknown one)."""
    return _CATALOGUE[name]


def render_markdown() -> str:
    """``docs/metrics.md``: the catalogue as tables, one per area."""
    lines = [
        "# gpuscope metrics",
        "",
        "Generated from `src/gpuscope/contract/catalogue.py` by `gpuscope generate`; do not edit.",
        "",
    ]
    areas: dict[str, list[Metric]] = {}
    for metric in all_metrics():
        areas.setdefault(metric.area, []).append(metric)
    for area, metrics in areas.items():
        lines += [f"## {area}", "", "| name | type | unit | labels | help |", "|---|---|---|---|---|"]
        for m in metrics:
            labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
            help_text = m.help
            if m.buckets:
                help_text += " Buckets: " + ", ".join(f"{b:g}" for b in m.buckets) + "."
            lines.append(f"| `{m.name}` | {m.type} | {m.unit or '—'} | {labels} | {help_text} |")
        lines.append("")
    return "\n".join(lines)

