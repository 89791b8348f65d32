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
import socket

import pytest
import requests

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
