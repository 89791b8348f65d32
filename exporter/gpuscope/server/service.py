"""Assembles the server's parts (model, timer, scheduler, engine, faults, metrics); no HTTP.

The API wraps a ``Service``; the tenancy benchmark drives one directly, which
is why nothing here imports aiohttp.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from .config import ServerConfig
from .engine import Deliver, Engine
from .faults import FAULTS, FaultInjector
from .metrics import RequestMetrics, StateCollector
from .model import build_model
from .scheduler import Scheduler
from .timer_glue import build_timer, instrument_model

log = logging.getLogger("gpuscope.server")


class Service:
    """Everything behind the API. ``start(deliver)`` starts the engine thread; ``close()`` stops it all."""

    def __init__(self, config: ServerConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model = build_model(config.model)
        self.device = next(self.model.parameters()).device
        self.timer = build_timer(config.timing, self.registry, config.timing_budget)
        self.instrumentation = instrument_model(self.timer, self.model) if config.timing != "off" else None
        names = [t.name for t in config.tenants]
        self.scheduler = Scheduler(config.tenants, config.scheduler, config.max_queue_per_tenant)
        self.faults = FaultInjector(set(names), self.device) if config.faults_enabled else None
        self.metrics = RequestMetrics(self.registry, names)
        self.engine = Engine(self.model, self.scheduler, self.timer, batch_size=config.batch_size,
                             max_wait_s=config.max_wait_s, deliver=lambda events: None,
                             metrics=self.metrics, faults=self.faults)
        self.registry.register(StateCollector(self.scheduler, self.device, self.engine.kv_usage,
                                              self._fault_state))

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
