"""Fixtures for the load-test tests: a paced SSE endpoint and a Locust runner in a subprocess.

Locust monkey-patches the whole process with gevent when imported, which would
turn every other test's threads into greenlets; so Locust only ever runs in a
child process here, exactly as users run it.

The paced endpoint is a stand-in with known timing, not a model server: it lets
a test check that the client measures TTFT and inter-token gaps that the server
really produced. With ``dialect = "vllm"`` and a ``model`` it answers as vLLM's
OpenAI server does (the chunk shapes of ``fixtures/vllm_*.sse``, ``/v1/models``,
404 for a model it does not serve). Everything that needs real serving behaviour
runs against ``gpuscope serve``.

A run's outcome must not depend on how fast the machine is, so a test that needs
users cut mid-stream, or counts that stop changing, does not end Locust after a
fixed time: the paced server streams a set number of requests in full and holds
every later one open after its first token; the test waits until every user sits
in a held stream (and Locust's CSV shows every finished request), then stops
Locust with Ctrl-C (SIGINT), as a user does. Not SIGTERM: Locust installs its
SIGTERM handler only after a headless shape run ends, and gpuscope's locustfile
always has a shape, so SIGTERM kills the run before it writes any report.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from gpuscope.loadtest.runtools import locust_ignored_ctrl_c
from gpuscope.ops import procs

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE_DIR = REPO / "loadtest"


@dataclass
class PacedServer:
    """Streams ``max_tokens`` chunks: the first after ``first_s``, then one every ``gap_s``.

    With ``hold_after`` set, the requests after the first ``hold_after`` stream one token and
    then stay open until the fixture ends (``held`` lists them): a closed-loop user that sends
    one ends up waiting in it, so a test knows when every user is mid-stream and done counting.
    """

    first_s: float = 0.15
    gap_s: float = 0.05
    fail_every: int = 0  # every nth request gets HTTP 503 (0: never); held ones never fail
    hold_after: int | None = None
    #: "plain": a chunk per token (text, no finish_reason), then [DONE]. "vllm": vLLM's chunks: the
    #: second token's text is empty, the last carries finish_reason "length", and with
    #: stream_options.include_usage a usage chunk ("choices": []) comes before [DONE].
    dialect: str = "plain"
    #: The model GET /v1/models lists and a vLLM-dialect request must name; None: no /v1/models (404).
    model: str | None = None
    url: str = ""
    received: list[dict] = field(default_factory=list)
    held: list[dict] = field(default_factory=list)
    release: asyncio.Event | None = None  # set at teardown: held streams end

    async def models(self, request: web.Request) -> web.Response:
        if self.model is None:
            raise web.HTTPNotFound()
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm", "root": self.model,
             "parent": None, "max_model_len": 4096, "permission": []}]})

    def _chunk(self, text: str, finish: str | None = None) -> bytes:
        if self.dialect == "plain":
            chunk: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        else:
            chunk = {"id": "cmpl-paced", "object": "text_completion", "created": 0, "model": self.model,
                     "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                  "stop_reason": None}], "usage": None}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tenant = request.headers.get("X-Tenant")
        self.received.append({"tenant": tenant, "authorization": request.headers.get("Authorization"),
                              **body})
        if self.dialect == "vllm" and body.get("model") != self.model:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}},
                                     status=404)
        hold = self.hold_after is not None and len(self.received) > self.hold_after
        if not hold and self.fail_every and len(self.received) % self.fail_every == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await asyncio.sleep(self.first_s)
            n, vllm = int(body["max_tokens"]), self.dialect == "vllm"
            for i in range(1 if hold else n):
                if i:
                    await asyncio.sleep(self.gap_s)
                text = "" if vllm and i == 1 else f" t{i}"
                await response.write(self._chunk(text, "length" if vllm and i == n - 1 else None))
            if not hold and vllm and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": "cmpl-paced", "object": "text_completion", "created": 0, "model": self.model,
                         "choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                  "total_tokens": len(body["prompt"]) + n,
                                                  "completion_tokens": n}}
                await response.write(f"data: {json.dumps(usage)}\n\n".encode())
            if hold:
                self.held.append({"tenant": tenant})
                assert self.release is not None
                await self.release.wait()
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
    app.router.add_get("/v1/models", server.models)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        server.release = asyncio.Event()
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
    loop.call_soon_threadsafe(server.release.set)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _locust_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE_DIR), "--headless", *args]


def _locust_env(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def run_locust(args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
               cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``locust -f loadtest/ ARGS`` headless in a child process (this Python's Locust); its output."""
    return subprocess.run(_locust_command(args), cwd=cwd, env=_locust_env(env), capture_output=True,
                          text=True, timeout=timeout)


class LocustProcess:
    """``locust -f loadtest/ ARGS`` running until :meth:`stop`; its output goes to ``log_dir/locust.log``.

    ``with LocustProcess(args, tmp_path) as locust: ...; result = locust.stop()``; leaving the
    block kills a Locust that is still running (a failed test). Stopped as the drill stops it: Ctrl-C,
    again if Locust has not acted on it (``runtools.locust_ignored_ctrl_c``), SIGKILL after 120 s.
    """

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.child = procs.Child(_locust_command(args), name="locust", cwd=REPO, env=_locust_env(env),
                                 log_path=log_dir / "locust.log", stop_signal=signal.SIGINT, grace_s=120.0,
                                 signal_again=locust_ignored_ctrl_c).start()

    def running(self) -> bool:
        """True while Locust runs; fails the test (with its output) if it exited on its own."""
        if not self.child.running:
            pytest.fail(f"locust exited with {self.child.poll()}:\n{self.stderr()[-3000:]}")
        return True

    def stderr(self) -> str:
        """Everything Locust wrote (its log lines go to stderr, its summary to stdout)."""
        return self.child.output()

    def stop(self) -> subprocess.CompletedProcess[str]:
        """Ctrl-C: Locust stops its users, writes its reports and exits; its exit code and output."""
        self.running()
        code = self.child.stop()
        return subprocess.CompletedProcess(self.child.argv, code, self.stderr(), self.stderr())

    def __enter__(self) -> LocustProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.child.kill()
        self.child.stop()


def csv_request_count(prefix: Path, name: str) -> int | None:
    """``Request Count`` of entry ``name`` in Locust's ``PREFIX_stats.csv`` (None: not written yet).

    Locust rewrites the file in place every second, so a read can catch it half written.
    """
    try:
        with open(f"{prefix}_stats.csv", newline="") as f:
            rows = {row["Name"]: row for row in csv.DictReader(f)}
        return int(rows[name]["Request Count"])
    except (OSError, KeyError, ValueError, TypeError, csv.Error):
        return None
