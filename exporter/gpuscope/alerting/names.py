"""Names of the recording rules, for dashboards and other rules to import (never retype them).

Names follow ``gpuscope:<what>:<aggregation>``, where ``<what>`` is the catalogue metric without its
``gpuscope_`` prefix. Window lengths are not in the names: the test profile records the same series
over compressed windows. Labels kept by each rule are listed next to it.
"""

from __future__ import annotations

from gpuscope import catalogue as m


def _base(metric: m.Metric) -> str:
    return metric.name.removeprefix("gpuscope_")


def quantile(metric: m.Metric, q: str) -> str:
    """``gpuscope:<histogram>:<q>``, q one of p50, p99, p99_baseline, samples_rate."""
    return f"gpuscope:{_base(metric)}:{q}"


# Latency quantiles over the latency window (NaN-free: absent while there is no traffic).
#: {job, instance, op, device}
REGION_P50 = quantile(m.REGION_GPU_SECONDS, "p50")
REGION_P99 = quantile(m.REGION_GPU_SECONDS, "p99")
#: Median of the recorded p99 over the baseline window: what "normal" is for this op.
REGION_P99_BASELINE = quantile(m.REGION_GPU_SECONDS, "p99_baseline")
#: Timed regions per second.
REGION_SAMPLES_RATE = quantile(m.REGION_GPU_SECONDS, "samples_rate")
#: {job, instance} (all tenants together: the endpoint's latency)
TTFT_P50 = quantile(m.REQUEST_TTFT, "p50")
TTFT_P99 = quantile(m.REQUEST_TTFT, "p99")
TTFT_P99_BASELINE = quantile(m.REQUEST_TTFT, "p99_baseline")
TTFT_SAMPLES_RATE = quantile(m.REQUEST_TTFT, "samples_rate")
E2E_P50 = quantile(m.REQUEST_E2E, "p50")
E2E_P99 = quantile(m.REQUEST_E2E, "p99")
E2E_P99_BASELINE = quantile(m.REQUEST_E2E, "p99_baseline")
E2E_SAMPLES_RATE = quantile(m.REQUEST_E2E, "samples_rate")
ITL_P50 = quantile(m.REQUEST_ITL, "p50")
ITL_P99 = quantile(m.REQUEST_ITL, "p99")
#: {job, instance, tenant}
QUEUE_P50 = quantile(m.REQUEST_QUEUE, "p50")
QUEUE_P99 = quantile(m.REQUEST_QUEUE, "p99")
QUEUE_P99_BASELINE = quantile(m.REQUEST_QUEUE, "p99_baseline")
QUEUE_SAMPLES_RATE = quantile(m.REQUEST_QUEUE, "samples_rate")

# SLO burn rates: bad fraction / error budget; label ``window`` holds the window (e.g. "1h").
#: {job, window}
SLO_TTFT_BURN_RATE = "gpuscope:slo_ttft:burn_rate"
SLO_AVAILABILITY_BURN_RATE = "gpuscope:slo_availability:burn_rate"

# Memory floor growth (memory.py): bytes per second. The slow one is the slowest growth of the floor
# over any interval of the leak span, present only with enough history and growth that is not fading.
#: {job, instance, device}
MEMORY_GROWTH_RATE = f"gpuscope:{_base(m.DEVICE_MEMORY_ALLOCATED)}:floor_growth_rate"
MEMORY_GROWTH_RATE_FAST = f"gpuscope:{_base(m.DEVICE_MEMORY_ALLOCATED)}:floor_growth_rate_fast"
#: {job, instance, gpu}
GPU_MEMORY_GROWTH_RATE = f"gpuscope:{_base(m.GPU_MEMORY_USED)}:floor_growth_rate"
GPU_MEMORY_GROWTH_RATE_FAST = f"gpuscope:{_base(m.GPU_MEMORY_USED)}:floor_growth_rate_fast"

#: Share of the instance's tenant GPU time each tenant got over the starvation window. {job, instance, tenant}
TENANT_GPU_SHARE = f"gpuscope:{_base(m.TENANT_GPU_SECONDS).removesuffix('_total')}:share"

#: 1 while a degradation dimension holds on a server instance, else 0; label ``dimension`` is one of
#: ``DIMENSIONS``. {job, instance, dimension}. For dashboards; the composite reads the per-device one.
DEGRADATION = "gpuscope:degradation:active"
#: 1 while a dimension holds on one device of a server instance (absent otherwise); starvation, a
#: property of the instance's queues, is recorded on every device of the instance.
#: {job, instance, device, dimension}. GPUServiceDegraded fires when two are 1 on the same device.
DEGRADATION_DEVICE = "gpuscope:degradation:device_active"
DIMENSIONS = ("latency_spike", "memory_leak", "starvation")

# Bottleneck classification, per host. {instance, host} where instance is the node_exporter's.
#: Busiest CPU core (1 − idle share), GPU utilization (0 on hosts without GPUs), fullest memory
#: (host RAM or any GPU's framebuffer; the two are also recorded on their own).
HOST_CPU_BUSY = "gpuscope:host_cpu_busy:ratio"
HOST_GPU_BUSY = "gpuscope:host_gpu_busy:ratio"
HOST_RAM_USED = "gpuscope:host_ram_used:ratio"
HOST_GPU_MEMORY_USED = "gpuscope:host_gpu_memory_used:ratio"
HOST_MEMORY_USED = "gpuscope:host_memory_used:ratio"
#: Value 1, label ``class`` one of ``BOTTLENECK_CLASSES``: exactly one class per host.
BOTTLENECK_CLASS = "gpuscope:bottleneck:class"
BOTTLENECK_CLASSES = ("memory_pressure", "idle", "gpu_bound", "cpu_bound")
