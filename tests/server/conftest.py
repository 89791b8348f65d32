"""A real ``gpuscope serve`` app on 127.0.0.1 (free port), run on its own event-loop thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from gpuscope.server.config import ModelSpec, ServerConfig, parse_tenants
from tests.conftest import wait_for

TOKEN = "test-token-0123456789abcdef"


def small_config(**overrides) -> ServerConfig:
    """CI-sized server: a 1-layer model, short context, small batches and queues."""
    base = ServerConfig(
        model=ModelSpec(layers=1, dim=64, heads=4, context=256),
        tenants=parse_tenants("alpha:0.7:high,beta:0.3:low"),
        default_tenant="alpha", max_batch_size=4, max_queue_per_tenant=16, max_tokens_limit=64,
        max_body_bytes=4096, timing="all")
    return replace(base, **overrides).validate()


class ServerThread:
    """Service + aiohttp app on a private loop thread; ``url`` is ready once started."""

    def __init__(self, config: ServerConfig) -> None:
        from gpuscope.server.api import build_app
        from gpuscope.server.service import Service

        self.config = config
        self.service = Service(config)
        self.app = build_app(self.service)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)
        self._started = threading.Event()
        self.port = 0

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        import requests  # imported here so the GPU machine (no requests/aiohttp) can collect test_gpu.py

        self._thread.start()
        assert self._started.wait(30), "server did not start"

        def ready() -> bool:
            try:
                return requests.get(self.url + "/readyz", timeout=5).status_code == 200
            except requests.RequestException:  # a busy machine: ask again until the deadline
                return False

        wait_for(ready, timeout=60, what="/readyz")
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(15)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.service.registry.get_sample_value(name, labels or {})

    def complete(self, prompt: str = "hello", max_tokens: int = 4, tenant: str | None = None, **extra):
        import requests

        headers = {"X-Tenant": tenant} if tenant else {}
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return requests.post(self.url + "/v1/completions", json=body, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(small_config()).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fault_server():
    srv = ServerThread(small_config(faults_enabled=True, faults_token=TOKEN,
                                    tenants=parse_tenants("alpha:0.5:normal,beta:0.5:normal"))).start()
    yield srv
    srv.stop()
