"""Assembles the server's parts (model, timer, scheduler, engine, faults, metrics); no HTTP.

The API wraps a ``Service``; the tenancy benchmark drives one directly, which
is why nothing here imports aiohttp. The model is the toy ``TinyGPT``, or with
``--model.hf DIR`` a local Hugging Face causal LM (``hf.py``, imported only then).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, ProcessCollector

from gpuscope.contract.choices import MetricNames

from .config import ServerConfig, TimingMode
from .engine import Deliver, Engine
from .faults import FAULTS, FaultInjector
from .hf import load_runner
from .metrics import RequestMetrics, StateCollector, VllmRequestMetrics, VllmStateCollector
from .model import ModelRunner, TinyRunner, build_model
from .profile.capture import ProfileCapture
from .scheduler import Scheduler
from .step_timing import build_timer, enable_kernel_busy

log = logging.getLogger("gpuscope.server")


def build_runner(config: ServerConfig) -> ModelRunner:
    """The toy model's runner, or the Hugging Face one (ConfigError when the folder is not a model)."""
    if config.model.hf is not None:
        return load_runner(config.model)
    return TinyRunner(build_model(config.model))


class Service:
    """Everything behind the API. ``start(deliver)`` starts the engine thread; ``close()`` stops it all."""

    def __init__(self, config: ServerConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        # process_start_time_seconds (and CPU, memory, descriptors), as vLLM's default registry has:
        # the memory alerts tell a restart from it, whatever the memory does across the restart.
        ProcessCollector(registry=self.registry)
        self.runner = build_runner(config)
        self.model = self.runner.module
        self.device = self.runner.device
        vllm = config.metric_names == MetricNames.VLLM
        # vLLM times no kernels: under its names the timer's metrics stay off /metrics.
        self.timer = build_timer(config.timing, CollectorRegistry() if vllm else self.registry,
                                 config.timing_budget)
        self.instrumentation = self.runner.instrument(self.timer) if config.timing != TimingMode.OFF else None
        if config.timing_kernel_busy:
            enable_kernel_busy(self.timer)
        if config.model.cuda_graphs:
            self.runner.use_cuda_graphs(self.timer)  # captured at the engine's warm-up
        names = [t.name for t in config.tenants]
        self.scheduler = Scheduler(config.tenants, config.scheduler, config.max_queue_per_tenant)
        self.faults = FaultInjector(set(names), self.device) if config.faults_enabled else None
        self.metrics = (VllmRequestMetrics(self.registry, config.model_name) if vllm
                        else RequestMetrics(self.registry, names))
        self.profile = None
        if config.profile is not None:
            self.profile = ProfileCapture(config.profile, self.registry, timer=self.timer,
                                          instrumentation=self.instrumentation, device=self.device,
                                          instance=config.instance)
        self.engine = Engine(self.runner, self.scheduler, self.timer, batch_size=config.batch_size,
                             max_wait_s=config.max_wait_s, deliver=lambda events: None,
                             metrics=self.metrics, faults=self.faults, profile=self.profile)
        self.registry.register(
            VllmStateCollector(self.scheduler, self.engine.kv_usage, config.model_name) if vllm
            else StateCollector(self.scheduler, self.device, self.engine.kv_usage, self._fault_state))

    def _fault_state(self) -> dict[str, bool]:
        return self.faults.active() if self.faults is not None else dict.fromkeys(FAULTS, False)

    def start(self, deliver: Deliver) -> None:
        self.engine._deliver = deliver
        self.engine.start()

    def close(self, timeout: float = 5.0) -> None:
        self.engine.stop(timeout)
        if self.instrumentation is not None:
            self.instrumentation.remove()
        try:
            self.timer.flush(timeout=timeout)
        finally:
            self.timer.close()
