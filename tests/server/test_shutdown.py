"""``gpuscope serve`` on SIGTERM: stop admitting, let running requests finish within the grace, end
the rest with an error chunk and ``[DONE]``, count each outcome, exit 0.

The model is slowed with the latency fault so a stream is still running when the signal comes,
and the starvation fault keeps one tenant's request queued (never started).
"""

from __future__ import annotations

import json
import re
import signal
import threading

import pytest
import requests

from tests.conftest import usage_error, wait_for
from tests.server.test_http_hardening import ENV, ServeProcess

TOKEN = "shutdown-test-token-0123456789"
SLOW = ["--model.context", "1024", "--request.max-tokens", "900", "--faults.enable", "--tenants",
        "alpha:0.5,beta:0.5"]


def _start(tmp_path, grace: str) -> ServeProcess:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    server = ServeProcess(tmp_path / "serve.log", *SLOW, "--faults.token-file", str(token),
                          "--shutdown.grace", grace)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = requests.post(server.url + "/admin/faults/latency_spike", headers=auth, timeout=30,
                      json={"extra_passes": 256, "duration_s": 600})
    assert r.status_code == 200, r.text
    return server


class Stream:
    """A streaming completion read on a thread: its ``data:`` payloads, and whether the first came."""

    def __init__(self, url: str, max_tokens: int, tenant: str = "alpha") -> None:
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(url, body, tenant), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict, tenant: str) -> None:
        try:
            with requests.post(url + "/v1/completions", json=body, headers={"X-Tenant": tenant}, stream=True,
                               timeout=120) as r:
                assert r.status_code == 200, r.text
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        self.events.append(line[6:].decode())
                        self.first.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.first.set()

    def join(self, timeout: float = 120) -> list[str]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream never ended"
        assert self.error is None, repr(self.error)
        return self.events


def _drained(log: str) -> dict[str, int]:
    match = re.search(r"shutdown drained in [\d.]+s: (.*)", log)
    assert match, log[-3000:]
    return {k: int(v) for k, v in (part.rsplit(" ", 1) for part in match.group(1).split(", "))}


def _draining(server: ServeProcess) -> bool:
    try:
        return requests.get(server.url + "/readyz", timeout=10).status_code == 503
    except requests.ConnectionError:
        pytest.fail("the server exited before it was seen draining")


@pytest.mark.slow
def test_sigterm_lets_a_running_stream_finish_and_answers_new_requests_503(tmp_path):
    server = _start(tmp_path, "60s")
    try:
        stream = Stream(server.url, 150)
        assert stream.first.wait(60) and not stream.error
        server.child.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: _draining(server), timeout=30, what="/readyz 503 after SIGTERM")
        assert requests.get(server.url + "/healthz", timeout=10).status_code == 200  # alive, not ready
        r = requests.post(server.url + "/v1/completions", json={"prompt": "late"}, timeout=30)
        assert r.status_code == 503 and r.headers["Retry-After"] == "60", r.text
        assert "shutting down" in r.json()["error"]["message"]
        events = stream.join()
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 150
        assert server.child.wait(60) == 0
    finally:
        server.stop()
    log = server.log()
    counts = _drained(log)
    assert counts["completed"] == 1 and counts["rejected"] == 1, counts
    assert counts["aborted_running"] == counts["aborted_queued"] == 0, counts
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.mark.slow
def test_what_runs_at_the_end_of_the_grace_ends_with_an_error_chunk_and_done(tmp_path):
    server = _start(tmp_path, "1s")
    try:
        requests.post(server.url + "/admin/faults/starvation", json={"tenant": "beta", "duration_s": 600},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).raise_for_status()
        stream = Stream(server.url, 900)
        queued = Stream(server.url, 10, tenant="beta")  # starved: stays queued
        results: dict[str, requests.Response] = {}

        def collect() -> None:
            results["r"] = requests.post(server.url + "/v1/completions", timeout=120,
                                         headers={"X-Tenant": "alpha"},
                                         json={"prompt": "hi", "max_tokens": 900, "ignore_eos": True})

        blocking = threading.Thread(target=collect, daemon=True)
        blocking.start()
        assert stream.first.wait(60) and not stream.error
        wait_for(lambda: server.metric("gpuscope_queue_depth", tenant="beta") == 1
                 and server.metric("gpuscope_requests_running", tenant="alpha") == 2, timeout=60,
                 what="one queued and two running requests")
        server.child.popen.send_signal(signal.SIGTERM)

        events = stream.join()
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["message"] == "server shutting down", error
        assert len(events) < 900  # it was cut, not finished
        queued_events = queued.join()
        assert queued_events[-1] == "[DONE]" and json.loads(queued_events[-2])["error"]["message"] == \
            "server shutting down"
        assert all('"text"' not in e for e in queued_events[:-2])  # it never started
        blocking.join(60)
        r = results["r"]
        assert r.status_code == 503 and r.json()["error"]["message"] == "server shutting down", r.text
        assert server.child.wait(60) == 0
    finally:
        server.stop()
    counts = _drained(server.log())
    assert counts["aborted_running"] == 2 and counts["aborted_queued"] == 1, counts
    assert counts["completed"] == 0, counts


@pytest.mark.parametrize("flag, value, message", [
    ("--shutdown.grace", "soon", "is not a duration"),
    ("--web.header-timeout", "0", "must be greater than zero"),
    ("--web.max-connections", "0", "--web.max-connections must be at least 1"),
])
def test_bad_shutdown_and_limit_flags_are_one_line(flag, value, message):
    line = usage_error("gpuscope", "serve", flag, value, env=ENV)
    assert message in line, line


@pytest.mark.slow
def test_a_second_signal_ends_the_grace_now(tmp_path):
    server = _start(tmp_path, "600s")
    try:
        stream = Stream(server.url, 900)
        assert stream.first.wait(60) and not stream.error
        server.child.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: _draining(server), timeout=30, what="/readyz 503 after SIGTERM")
        server.child.popen.send_signal(signal.SIGINT)  # Ctrl-C after `kill`: do not wait 10 minutes
        events = stream.join()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "server shutting down"
        assert server.child.wait(120) == 0
    finally:
        server.stop()
    counts = _drained(server.log())
    assert counts["aborted_running"] == 1, counts
