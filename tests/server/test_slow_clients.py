"""``gpuscope serve`` against slow, short and too many clients: read deadlines and a connection cap.

A client that never finishes its headers, or sends a body shorter than its ``Content-Length``, gets
a 408 JSON answer and its connection closes; beyond ``--web.max-connections`` a new connection
closes a stalled one (or gets 503 when all are answering); descriptors stay bounded. Each close is
counted in ``gpuscope_http_connections_closed_total{reason}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time

import pytest
import requests

from gpuscope.server.limits import SPARE_SOCKETS
from tests.conftest import wait_for
from tests.server.test_http_hardening import ServeProcess

CLOSED = "gpuscope_http_connections_closed_total"


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read until the server closes: (status, headers, body)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), lines[0]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _connect(server: ServeProcess, sent: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    if sent:
        sock.sendall(sent)
    return sock


def test_this_aiohttp_has_the_connection_state_the_limits_read():
    from gpuscope.server import limits

    assert limits.SUPPORTED  # else an aiohttp upgrade silently turned the deadlines and cap off


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    server = ServeProcess(tmp_path_factory.mktemp("slow") / "serve.log", "--web.header-timeout", "1s",
                          "--web.body-timeout", "1s")
    yield server
    server.stop()


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"],
                         ids=["nothing", "half-sent-headers"])
def test_headers_not_in_within_the_deadline_get_408_and_a_close(quick, sent):
    before = quick.metric(CLOSED, reason="header_timeout")
    with _connect(quick, sent) as sock:
        status, headers, body = _answer(sock)
    assert status == 408 and headers["connection"] == "close"
    assert "not received within 1s" in json.loads(body)["error"]["message"]
    wait_for(lambda: quick.metric(CLOSED, reason="header_timeout") == before + 1, timeout=10,
             what="the header timeout counted")


def test_a_body_shorter_than_its_content_length_gets_408_and_a_close(quick):
    before = quick.metric(CLOSED, reason="body_timeout")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    with _connect(quick, head + b'{"prompt": "hel') as sock:
        status, _, body = _answer(sock)
    assert status == 408, body
    assert "request body not received within 1s" in json.loads(body)["error"]["message"]
    wait_for(lambda: quick.metric(CLOSED, reason="body_timeout") == before + 1, timeout=10,
             what="the body timeout counted")


def test_a_kept_alive_connection_gets_a_fresh_header_deadline_per_request(quick):
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(quick, request) as sock:
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # the next request, stalled
        status, _, _ = _answer(sock)
    assert status == 408


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_connection_cap_evicts_stalled_connections_and_bounds_descriptors(tmp_path):
    server = ServeProcess(tmp_path / "serve.log", "--web.max-connections", "8",
                          "--web.header-timeout", "60s")
    stalled: list[socket.socket] = []
    try:
        baseline = _open_fds(server.child.pid)
        for _ in range(60):  # each sends half a request line and stalls
            stalled.append(_connect(server, b"GET /v1/mod"))
        wait_for(lambda: (server.metric(CLOSED, reason="evicted") or 0) >= 60 - 8, timeout=60,
                 what="the stalled connections beyond the cap evicted")
        # The evicted ones are closed (after a short linger): what stays open is the cap's worth, and
        # the metric scrapes' connection.
        wait_for(lambda: _open_fds(server.child.pid) <= baseline + 8 + 2, timeout=30,
                 what=f"descriptors back to the cap (baseline {baseline})")
        # A real request still gets in, and is answered.
        r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert server.metric(CLOSED, reason="refused") == 0
    finally:
        for sock in stalled:
            with contextlib.suppress(OSError):
                sock.close()
        server.stop()


class _PeakDescriptors:
    """The most descriptors a process was seen holding, sampled on a thread until ``stop``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, _open_fds(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            with contextlib.suppress(FileNotFoundError):  # a descriptor closed while listed
                self.peak = max(self.peak, _open_fds(self.pid))

    def stop(self) -> int:
        self._done.set()
        self._thread.join(10)
        return self.peak


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.slow
def test_a_burst_of_connections_never_holds_more_descriptors_than_the_cap_allows(tmp_path):
    """200 connections opened at once against a cap of 32: the server accepts only while fewer than
    the cap and its spare sockets (SPARE_SOCKETS, for answered connections lingering) are open, so its
    descriptors stay within that however fast they come; it takes them all in the end, and still
    answers once the burst is gone."""
    cap, burst = 32, 200
    server = ServeProcess(tmp_path / "serve.log", "--web.max-connections", str(cap),
                          "--web.header-timeout", "60s")
    pid = server.child.pid
    # Beyond the baseline: the cap's sockets, its spares, and 2 for files the process opens as it runs.
    allowed = _open_fds(pid) + cap + SPARE_SOCKETS + 2
    peak = _PeakDescriptors(pid)
    sockets: list[socket.socket] = []
    try:
        for _ in range(burst):  # as fast as connect() goes; what the backlog cannot take, the kernel retries
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", server.port))
            sockets.append(sock)
        # Every connection beyond the cap is accepted in turn, each evicting a stalled one: the server
        # has taken the whole burst once all but the cap's worth are closed on the client.
        waiting = list(sockets)
        deadline = time.monotonic() + 90
        closed = 0
        while closed < burst - cap:
            assert time.monotonic() < deadline, f"the server closed {closed} of {burst - cap} in 90s"
            readable, _, _ = select.select(waiting, [], [], 0.5)
            for sock in readable:
                if _closed_by_server(sock):
                    waiting.remove(sock)
                    closed += 1
        seen = peak.stop()
        assert seen <= allowed, f"{seen} descriptors open at the peak; at most {allowed} allowed"
    finally:
        peak.stop()
        for sock in sockets:
            sock.close()
    wait_for(lambda: _open_fds(pid) <= allowed - cap - SPARE_SOCKETS, timeout=30,
             what="the burst's descriptors closed")
    r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert server.metric(CLOSED, reason="evicted") >= burst - cap
    server.stop()


@pytest.mark.slow
def test_over_the_cap_with_every_connection_answering_a_new_one_gets_503(tmp_path):
    token = tmp_path / "token"
    token.write_text("cap-test-token-0123456789")
    server = ServeProcess(tmp_path / "serve.log", "--web.max-connections", "3", "--faults.enable",
                          "--faults.token-file", str(token), "--model.context", "1024",
                          "--request.max-tokens", "900")
    auth = {"Authorization": "Bearer cap-test-token-0123456789"}
    requests.post(server.url + "/admin/faults/latency_spike", json={"extra_passes": 256, "duration_s": 600},
                  headers=auth, timeout=30).raise_for_status()
    streams: list[requests.Response] = []
    try:
        body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
        for _ in range(3):
            r = requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60)
            assert r.status_code == 200
            streams.append(r)
        refused: dict[str, object] = {}

        def try_one() -> bool:
            with _connect(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") as sock:
                status, headers, raw = _answer(sock)
            refused.update(status=status, headers=headers, body=raw)
            return status == 503

        wait_for(try_one, timeout=30, what="a 503 over the cap")
        assert refused["headers"]["retry-after"] == "1"
        assert "too many connections" in json.loads(refused["body"])["error"]["message"]
    finally:
        for r in streams:
            r.close()
    wait_for(lambda: requests.get(server.url + "/healthz", timeout=10).status_code == 200, timeout=60,
             what="room again once the streams closed")
    assert server.metric(CLOSED, reason="refused") >= 1
    server.stop()
