"""The server's metrics: request histograms (with trace-id exemplars) and collectors of cached state.

Histograms and counters are observed by the engine thread as requests
progress; queue depth, running requests, tenant GPU seconds, quotas, KV-cache
usage, device memory and active faults are read at scrape time from state the
engine already keeps, so a scrape never waits on the model.

With ``--metrics.names vllm`` the same observations are exposed as vLLM's V1 engine exposes them
(``VllmRequestMetrics``, ``VllmStateCollector``; definitions in ``gpuscope.contract.upstream``), so the
bundle's vLLM source can be run end to end against this server.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue as c
from gpuscope.contract import upstream as up

from .scheduler import Scheduler

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RequestMetrics:
    """Per-tenant request histograms and counters; every tenant's series exist from the start."""

    def __init__(self, registry: CollectorRegistry, tenants: Iterable[str]) -> None:
        self.ttft = c.REQUEST_TTFT.create(registry)  # as the client sees it (observed by the API)
        self.engine_ttft = c.REQUEST_ENGINE_TTFT.create(registry)  # at the sampling step (the engine)
        self.itl = c.REQUEST_ITL.create(registry)
        self.tpot = c.REQUEST_TPOT.create(registry)
        self.e2e = c.REQUEST_E2E.create(registry)
        self.queue = c.REQUEST_QUEUE.create(registry)
        self.prefill = c.REQUEST_PREFILL.create(registry)
        self.decode = c.REQUEST_DECODE.create(registry)
        self.prompt_tokens = c.PROMPT_TOKENS.create(registry)
        self.generation_tokens = c.GENERATION_TOKENS.create(registry)
        self.requests = c.REQUESTS.create(registry)
        self.batch_size = c.BATCH_SIZE.create(registry)
        for tenant in tenants:
            for metric in (self.ttft, self.engine_ttft, self.itl, self.tpot, self.e2e, self.queue,
                           self.prefill, self.decode, self.prompt_tokens, self.generation_tokens):
                metric.labels(tenant)
            for outcome in OUTCOMES:
                self.requests.labels(tenant, outcome)
        for phase in ("prefill", "decode"):
            self.batch_size.labels(phase)

    @staticmethod
    def observe(histogram, tenant: str, value: float, trace_id: str) -> None:
        histogram.labels(tenant).observe(max(0.0, value), {"trace_id": trace_id})


class _One:
    """A labelled metric whose every ``labels(...)`` is one child: vLLM labels by served model and engine,
    not by tenant, so every tenant's requests count for the one model."""

    def __init__(self, child) -> None:
        self._child = child

    def labels(self, *_: str):
        return self._child


class _Discard:
    """What vLLM does not count: its HTTP layer rejects requests before the engine, and it has no
    batch-size histogram."""

    def labels(self, *_: str) -> _Discard:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class _FinishReasons:
    """``requests.labels(tenant, outcome)`` → ``vllm:request_success_total{finished_reason}``."""

    def __init__(self, children: dict[str, object]) -> None:
        self._children = children

    def labels(self, tenant: str, outcome: str):
        return self._children.get(outcome, _Discard())


class VllmRequestMetrics:
    """``RequestMetrics`` under vLLM's names, labels (model_name, engine 0) and buckets; no exemplars
    (vLLM attaches none). The TTFT clients see has no vLLM name: it is not exposed."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        values = (model_name, "0")

        def one(metric: c.Metric) -> _One:
            return _One(metric.create(registry).labels(*values))

        # vLLM's TTFT is taken in its engine, before detokenizing and the HTTP write: the engine's.
        self.engine_ttft, self.ttft = one(up.VLLM_TTFT), _Discard()
        self.itl, self.tpot = one(up.VLLM_ITL), one(up.VLLM_TPOT)
        self.e2e, self.queue = one(up.VLLM_E2E), one(up.VLLM_QUEUE)
        self.prefill, self.decode = one(up.VLLM_PREFILL), one(up.VLLM_DECODE)
        self.prompt_tokens = one(up.VLLM_PROMPT_TOKENS)
        self.generation_tokens = one(up.VLLM_GENERATION_TOKENS)
        success = up.VLLM_REQUEST_SUCCESS.create(registry)
        self.requests = _FinishReasons({reason: success.labels(*values, reason)
                                        for reason in up.VLLM_FINISH_REASONS})
        self.batch_size = _Discard()

    @staticmethod
    def observe(histogram, tenant: str, value: float, trace_id: str) -> None:
        histogram.labels(tenant).observe(max(0.0, value))


def _process_resident_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * _PAGE)
    except (OSError, ValueError, IndexError):
        return float("nan")


def device_memory(device: torch.device) -> tuple[float, float]:
    """(allocated, reserved) bytes: torch's allocator on CUDA, the process's resident memory on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.memory_reserved(device))
    resident = _process_resident_bytes()
    return resident, resident


def device_memory_total(device: torch.device) -> float:
    """Capacity leak alerts predict against: the GPU's memory, or on CPU the cgroup limit or RAM."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    physical = float(os.sysconf("SC_PHYS_PAGES") * _PAGE) if hasattr(os, "sysconf") else float("nan")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return float(text)
    return physical


class StateCollector:
    """Scrape-time view of scheduler, KV cache, device memory and faults.

    Exposes (one series per tenant / fault)::

        gpuscope_queue_depth{tenant="alpha"} 3.0
        gpuscope_requests_running{tenant="alpha"} 8.0
        gpuscope_tenant_gpu_seconds_total{tenant="alpha"} 12.5
        gpuscope_tenant_share_quota_ratio{tenant="alpha"} 0.7
        gpuscope_request_preemptions_total{tenant="beta"} 4.0
        gpuscope_kv_cache_usage_ratio 0.25
        gpuscope_device_memory_allocated_bytes{device="cpu"} 3.1e+08
        gpuscope_device_memory_total_bytes{device="cpu"} 8.3e+09
        gpuscope_fault_active{fault="latency_spike"} 0.0
    """

    #: Every family it yields.
    METRICS = (c.QUEUE_DEPTH, c.REQUESTS_RUNNING, c.TENANT_GPU_SECONDS, c.TENANT_SHARE_QUOTA, c.PREEMPTIONS,
               c.KV_CACHE_USAGE, c.DEVICE_MEMORY_ALLOCATED, c.DEVICE_MEMORY_RESERVED, c.DEVICE_MEMORY_TOTAL,
               c.FAULT_ACTIVE)

    def __init__(self, scheduler: Scheduler, device: torch.device, kv_usage: Callable[[], float],
                 faults: Callable[[], dict[str, bool]]) -> None:
        self._scheduler = scheduler
        self._device = device
        self._kv_usage = kv_usage
        self._faults = faults
        self._total = device_memory_total(device)  # fixed for the process's life: read once

    def describe(self):
        """The families by name, type and help, for the registry's check of duplicate names."""
        return [metric.family() for metric in self.METRICS]

    def collect(self):
        state = self._scheduler.state()
        families = {m: m.family() for m in (c.QUEUE_DEPTH, c.REQUESTS_RUNNING, c.TENANT_GPU_SECONDS,
                                             c.TENANT_SHARE_QUOTA, c.PREEMPTIONS)}
        for name, s in state.items():
            families[c.QUEUE_DEPTH].add_metric([name], s.queued)
            families[c.REQUESTS_RUNNING].add_metric([name], s.running)
            families[c.TENANT_GPU_SECONDS].add_metric([name], s.gpu_seconds)
            families[c.TENANT_SHARE_QUOTA].add_metric([name], s.quota)
            families[c.PREEMPTIONS].add_metric([name], s.preemptions)
        yield from families.values()
        kv = c.KV_CACHE_USAGE.family()
        kv.add_metric([], self._kv_usage())
        yield kv
        allocated, reserved = device_memory(self._device)
        label = str(self._device)
        for metric, value in ((c.DEVICE_MEMORY_ALLOCATED, allocated), (c.DEVICE_MEMORY_RESERVED, reserved),
                              (c.DEVICE_MEMORY_TOTAL, self._total)):
            family = metric.family()
            family.add_metric([label], value)
            yield family
        faults = c.FAULT_ACTIVE.family()
        for name, active in self._faults().items():
            faults.add_metric([name], 1.0 if active else 0.0)
        yield faults


class VllmStateCollector:
    """Scrape-time state under vLLM's names: every tenant's queue and batch summed, as vLLM's one
    scheduler would count them::

        vllm:num_requests_running{model_name="gpuscope-tiny",engine="0"} 8.0
        vllm:num_requests_waiting{model_name="gpuscope-tiny",engine="0"} 3.0
        vllm:kv_cache_usage_perc{model_name="gpuscope-tiny",engine="0"} 0.25
        vllm:num_preemptions_total{model_name="gpuscope-tiny",engine="0"} 4.0
    """

    #: Every family it yields.
    METRICS = (up.VLLM_RUNNING, up.VLLM_WAITING, up.VLLM_KV_CACHE, up.VLLM_PREEMPTIONS)

    def __init__(self, scheduler: Scheduler, kv_usage: Callable[[], float], model_name: str) -> None:
        self._scheduler = scheduler
        self._kv_usage = kv_usage
        self._values = [model_name, "0"]

    def describe(self):
        return [metric.family() for metric in self.METRICS]

    def collect(self):
        states = self._scheduler.state().values()
        for metric, value in ((up.VLLM_RUNNING, sum(s.running for s in states)),
                              (up.VLLM_WAITING, sum(s.queued for s in states)),
                              (up.VLLM_KV_CACHE, self._kv_usage()),
                              (up.VLLM_PREEMPTIONS, sum(s.preemptions for s in states))):
            family = metric.family()
            family.add_metric(self._values, value)
            yield family
