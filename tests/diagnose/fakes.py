"""Fakes for the diagnose tests: a host sampler with set readings and a /metrics server whose
counters and histograms advance with every scrape (the real exposition format, built with
prometheus_client from the catalogue's and vLLM's own metric definitions)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

from gpuscope.contract import catalogue as cat
from gpuscope.contract import upstream as up
from gpuscope.diagnose.host import HostReading


class FakeHost:
    """Stands in for ``HostSampler``: every reading is the one set."""

    def __init__(self, cpu: float, busiest_core: float | None = None, ram: float = 0.3) -> None:
        self.reading = HostReading(cpu, cpu if busiest_core is None else busiest_core, ram)

    def read(self) -> HostReading:
        return self.reading


class Server:
    """A gpuscope-serve-shaped (or vLLM-shaped) /metrics; ``step(registry_metrics)`` runs per scrape."""

    def __init__(self, vllm: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.vllm = vllm
        defs = {
            "running": up.VLLM_RUNNING if vllm else cat.REQUESTS_RUNNING,
            "waiting": up.VLLM_WAITING if vllm else cat.QUEUE_DEPTH,
            "kv": up.VLLM_KV_CACHE if vllm else cat.KV_CACHE_USAGE,
            "preemptions": up.VLLM_PREEMPTIONS if vllm else cat.PREEMPTIONS,
            "tokens": up.VLLM_GENERATION_TOKENS if vllm else cat.GENERATION_TOKENS,
            "ttft": up.VLLM_TTFT if vllm else cat.REQUEST_TTFT,
            "itl": up.VLLM_ITL if vllm else cat.REQUEST_ITL,
            "queue": up.VLLM_QUEUE if vllm else cat.REQUEST_QUEUE,
        }
        if not vllm:
            defs["region"] = cat.REGION_GPU_SECONDS
            defs["busy"] = cat.REGION_GPU_BUSY_RATIO
        self.m = {key: d.create(self.registry) for key, d in defs.items()}
        self.labels = {"model_name": "m", "engine": "0"} if vllm else {"tenant": "alpha"}
        self.steps: list[Callable[[Server], None]] = []
        self.scrapes = 0

    def of(self, key: str, **extra: str):
        metric = self.m[key]
        if key in ("region", "busy"):
            return metric.labels(**extra)
        if key == "kv" and not self.vllm:
            return metric
        return metric.labels(**self.labels)

    def body(self) -> bytes:
        for step in self.steps:
            step(self)
        self.scrapes += 1
        return generate_latest(self.registry)

    @contextmanager
    def serve(self) -> Iterator[str]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.body()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
        finally:
            httpd.shutdown()
            httpd.server_close()
