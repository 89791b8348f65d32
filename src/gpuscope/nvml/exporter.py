"""The exporter assembled: NVML start-up, discovery, one sampler per collector, XID watcher, registry,
and the exposition rendered in the background (``exposition``: what /metrics serves).

``Exporter(config, nv=fake)`` runs the same code on a fake NVML as on the real one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

from gpuscope.nvml.api import NVMLError, error_text, real_nvml, text
from gpuscope.nvml.calls import Calls
from gpuscope.nvml.collector_table import registered
from gpuscope.nvml.collectors import Collector, PodLabelled
from gpuscope.nvml.config import Config
from gpuscope.nvml.devices import Device, discover
from gpuscope.nvml.exposition import ExporterCollector, PinnedSnapshot, StalenessCollector
from gpuscope.nvml.health import Health
from gpuscope.nvml.podresources import PodResourcesWatcher
from gpuscope.nvml.rendered import RenderedExposition
from gpuscope.nvml.sampler import Sampler
from gpuscope.nvml.store import Store
from gpuscope.nvml.xid import XidWatcher

log = logging.getLogger("gpuscope.exporter")


class Exporter:
    """Owns every thread of the exporter; ``start()`` never raises on NVML trouble."""

    def __init__(self, config: Config, nv: Any = None, proc_root: str = "/proc",
                 xid_wait_ms: int = 500) -> None:
        self.config = config
        self.nv = nv if nv is not None else real_nvml()
        self.proc_root = proc_root
        self.xid_wait_ms = xid_wait_ms
        self.health = Health()
        self.store = Store()
        self.calls = Calls(self.nv, self.health)
        self.devices: list[Device] = []
        self.samplers: list[Sampler] = []
        self.xid: XidWatcher | None = None
        self.pods: PodResourcesWatcher | None = None  # pod attribution, when a socket is configured
        self.nvml_ok = False
        self.driver_version = ""
        self.registry = CollectorRegistry()  # everything, rendered on demand (tests, in-process use)
        self.exposition: RenderedExposition | None = None

    def start(self) -> Exporter:
        self._init_nvml()
        cfg = self.config
        state = ExporterCollector(self.store, self.health, self.devices, self.driver_version)
        own_process = ProcessCollector(registry=None)  # the exporter's own CPU and memory
        for collector in (state, StalenessCollector(self.store), own_process):
            self.registry.register(collector)
        pinned = PinnedSnapshot(state)
        # At most two renders per sampling interval: the rounds of every collector in one render.
        # The exporter's own process metrics go with them (reading /proc costs more than the rest
        # of a scrape; its CPU figure is then as fresh as the sampling interval).
        self.exposition = RenderedExposition(
            [pinned, own_process], [StalenessCollector(self.store, snapshot=pinned.served)],
            self.store.changed, min_period=cfg.interval / 2, on_error=self._render_failed).start()
        if cfg.pod_resources_socket and self.nvml_ok:  # no GPUs: nothing to attribute
            self.pods = PodResourcesWatcher(cfg.pod_resources_socket, self.health,
                                            interval=cfg.slow_interval).start()
        for collector in self._collectors():
            interval = cfg.slow_interval if collector.slow else cfg.interval
            sampler = Sampler(collector, self.devices, interval, cfg.call_timeout, self.store, self.health,
                              self.calls)
            self.samplers.append(sampler)
            sampler.start()
        if XidWatcher.name in cfg.collectors and self.devices:
            self.xid = XidWatcher(self.nv, self.devices, self.store, self.health, self.xid_wait_ms)
            self.xid.start()
        return self

    def _init_nvml(self) -> None:
        try:
            self.nv.nvmlInit()
        except NVMLError as exc:
            self.health.count_error("nvmlInit")
            log.warning("NVML unavailable (%s): serving exporter health with 0 GPUs", error_text(exc))
            return
        self.nvml_ok = True
        try:
            self.driver_version = text(self.nv.nvmlSystemGetDriverVersion())
        except NVMLError:
            self.health.count_error("nvmlSystemGetDriverVersion")
        self.devices = discover(self.nv, self.health)
        names = ", ".join(f"{d.label}={d.name}" for d in self.devices) or "none"
        log.info("NVML ready (driver %s): %d GPU(s) and MIG instance(s): %s",
                 self.driver_version or "?", len(self.devices), names)

    def _collectors(self) -> list[Collector]:
        """The enabled sampling collectors, built from their registrations (XID has its own thread)."""
        if not self.nvml_ok:
            return []
        built = [r.cls.build(self.calls, self.config, self.proc_root) for r in registered().values()
                 if r.name in self.config.collectors and issubclass(r.cls, Collector)]
        pods = self.pods
        return built if pods is None else [PodLabelled(c, pods.owner) for c in built]

    def _render_failed(self, exc: BaseException) -> None:
        self.health.count_error("render")
        self.health.log_once(("render", type(exc).__name__), logging.ERROR,
                             "rendering the exposition failed (counted as call=\"render\"; the last "
                             "good one is served): %r", exc)

    def metrics(self, accept: str) -> tuple[bytes, str]:
        """The /metrics body and content type for an ``Accept`` header (cached, see rendered.py)."""
        if self.exposition is None:
            raise RuntimeError("Exporter.metrics() before start()")
        return self.exposition.body(accept)

    def healthz(self) -> dict:
        """Body of ``/healthz``: always 200 while serving; says what is degraded."""
        now = time.time()
        snapshot = self.store.snapshot()
        return {
            "status": "ok",
            "nvml": self.nvml_ok,
            "gpus": len(self.devices),
            "gpus_lost": self.health.lost_count(),
            "staleness_seconds": {name: round(self.store.staleness(s, now), 3)
                                  for name, s in snapshot.items()},
        }

    def stop(self, timeout: float = 2.0) -> None:
        """Stop every thread; NVML is shut down only if no call is still wedged inside it."""
        if self.exposition is not None:
            self.exposition.stop(timeout)
        for sampler in self.samplers:
            sampler.stop()
        if self.xid is not None:
            self.xid.stop()
        if self.pods is not None:
            self.pods.stop()
        deadline = time.monotonic() + timeout
        for sampler in self.samplers:
            sampler.join(max(0.0, deadline - time.monotonic()))
        if self.xid is not None:
            self.xid.join(max(0.0, deadline - time.monotonic()))
        if self.pods is not None:
            self.pods.join(max(0.0, deadline - time.monotonic()))
        if self.nvml_ok and not any(s.wedged for s in self.samplers):
            try:
                self.nv.nvmlShutdown()
            except NVMLError:
                self.health.count_error("nvmlShutdown")
            self.nvml_ok = False
