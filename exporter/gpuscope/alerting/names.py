"""Names of the recording rules, for dashboards and other rules to import (never retype them).

Names follow ``gpuscope:<what>:<aggregation>``, where ``<what>`` is the catalogue metric without its
``gpuscope_`` prefix. Window lengths are not in the names: the test profile records the same series
over compressed windows. Labels kept by each rule are listed next to it.
"""

from __future__ import annotations

from gpuscope import catalogue as m


def _base(metric: m.Metric) -> str:
    return metric.name.removeprefix("gpuscope_")


#: What a latency histogram's recording rules record (latency.py), the last part of their names.
P50, P99, P99_BASELINE, SAMPLES_RATE = "p50", "p99", "p99_baseline", "samples_rate"
QUANTILE_SUFFIXES = (P50, P99, P99_BASELINE, SAMPLES_RATE)


def quantile(metric: m.Metric, q: str) -> str:
    """``gpuscope:<histogram>:<q>``, q one of P50, P99, P99_BASELINE, SAMPLES_RATE."""
    return f"gpuscope:{_base(metric)}:{q}"


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
#: {job, instance, tenant}
QUEUE_P50 = quantile(m.REQUEST_QUEUE, P50)
QUEUE_P99 = quantile(m.REQUEST_QUEUE, P99)
QUEUE_P99_BASELINE = quantile(m.REQUEST_QUEUE, P99_BASELINE)
QUEUE_SAMPLES_RATE = quantile(m.REQUEST_QUEUE, SAMPLES_RATE)

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
