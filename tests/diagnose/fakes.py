"""Fakes for the diagnose tests: a host sampler with set readings, a /metrics server whose
counters and histograms advance with every scrape (the real exposition format, built with
prometheus_client from the catalogue's and vLLM's own metric definitions), and a fake NVML whose
per-process utilization samples keep coming as the driver's do."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

from gpuscope.contract import catalogue as cat
from gpuscope.contract import upstream as up
from gpuscope.diagnose.host import HostReading
from tests.nvml.fake_nvml import FakeGpu, FakeNvml, FakeProcess


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


class SamplingNvml(FakeNvml):
    """``FakeNvml`` whose per-process SM samples keep coming, as NVML's do: before answering
    ``nvmlDeviceGetProcessUtilization`` it buffers one new sample (stamped now, in µs) per pid set in
    ``sm`` for that GPU. (The plain fake's samples are fixed, so a second round would find none.)"""

    def __init__(self, gpus: list[FakeGpu], sm: dict[int, dict[int, int]]) -> None:
        super().__init__(gpus)
        self.sm = sm  # GPU index → {pid: SM %}
        self._stamp = 0

    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp):
        address = ctypes.cast(handle, ctypes.c_void_p).value
        index = next(i for i, gpu in enumerate(self.gpus) if gpu.address == address)
        self._stamp = max(self._stamp + 1, int(time.time() * 1e6))
        fresh = [(pid, self._stamp, sm) for pid, sm in self.sm.get(index, {}).items()]
        self.gpus[index].proc_samples += fresh
        return super().nvmlDeviceGetProcessUtilization(handle, timeStamp)


def gpu_holding(pid: int, util: int, gib: float = 2.0) -> FakeGpu:
    """A GPU at ``util`` % whose one compute process is ``pid``, holding ``gib`` GiB."""
    return FakeGpu(util_gpu=util, processes=[FakeProcess(pid, int(gib * 2**30))])
