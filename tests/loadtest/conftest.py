"""Fixtures for the load-test tests: a paced SSE endpoint and a Locust runner in a subprocess.

Locust monkey-patches the whole process with gevent when imported, which would
turn every other test's threads into greenlets; so Locust only ever runs in a
child process here, exactly as users run it.

The paced endpoint is a stand-in with known timing, not a model server: it lets
a test check that the client measures TTFT and inter-token gaps that the server
really produced. Everything that needs real serving behaviour runs against
``gpuscope serve``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE_DIR = REPO / "loadtest"


@dataclass
class PacedServer:
    """Streams ``max_tokens`` chunks: the first after ``first_s``, then one every ``gap_s``."""

    first_s: float = 0.15
    gap_s: float = 0.05
    fail_every: int = 0  # every nth request gets HTTP 503 (0: never)
    url: str = ""
    received: list[dict] = field(default_factory=list)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append({"tenant": request.headers.get("X-Tenant"), **body})
        if self.fail_every and len(self.received) % self.fail_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await asyncio.sleep(self.first_s)
            for i in range(int(body["max_tokens"])):
                if i:
                    await asyncio.sleep(self.gap_s)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            pass  # Locust stopped a user mid-stream: expected at the end of every run
        return response


@pytest.fixture
def paced_server() -> Iterator[PacedServer]:
    server = PacedServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        server.url = f"http://127.0.0.1:{port}"
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10), "paced server did not start"
    yield server
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def run_locust(args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
               cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``locust -f loadtest/ ARGS`` headless in a child process (this Python's Locust); its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "locust", "-f", str(LOCUSTFILE_DIR), "--headless",
                           *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
