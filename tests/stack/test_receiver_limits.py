"""The alert receiver under slow and surplus clients: the exporter's connection limits, tested the same way.

Before: no connection cap and a listen backlog of 5 (about 490 stalled sockets held 325 threads,
and most new connections waited a second in the kernel's SYN retries).
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpuscope.contract import catalogue
from gpuscope.receiver import main as receiver
from gpuscope.util.bounded_http import CONNECTION_THREAD
from tests.conftest import wait_for
from tests.stack.test_receiver import notification

CLOSED = catalogue.RECEIVER_HTTP_CONNECTIONS_CLOSED.name


def _serve(on_notification=None, **limits) -> tuple[receiver.ReceiverServer, io.StringIO]:
    out = io.StringIO()
    log = receiver.NotificationLog(registry=CollectorRegistry(), out=out, on_notification=on_notification)
    server = receiver.make_server("127.0.0.1", 0, log, **limits)
    server.serve_in_thread()
    return server, out


def _stop(server: receiver.ReceiverServer) -> None:
    server.shutdown()
    server.server_close()


def _closed(url: str, reason: str) -> float | None:
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == CLOSED and sample.labels == {"reason": reason}:
                return sample.value
    return None


def _connection_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == CONNECTION_THREAD)


def _half_sent(server: receiver.ReceiverServer) -> socket.socket:
    sock = socket.create_connection(server.server_address[:2], timeout=30)
    sock.sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\n")  # no blank line: the request never ends
    return sock


def test_listen_backlog_is_a_normal_one() -> None:
    assert receiver.ReceiverServer.request_queue_size >= 128


def test_half_sent_connections_keep_threads_bounded_and_notifications_arriving() -> None:
    server, out = _serve(max_connections=8, read_timeout=300.0)  # no timeout during the test
    sockets = []
    try:
        for _ in range(200):
            sockets.append(_half_sent(server))
            assert _connection_threads() <= 8
        # Alertmanager's connection comes after all of them and evicts the longest-waiting one:
        # answered at once, not after a read timeout.
        started = time.monotonic()
        r = requests.post(server.url + "/alerts", json=notification(), timeout=60)
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 10
        assert json.loads(out.getvalue().splitlines()[0])["notification"]["status"] == "firing"
        assert _connection_threads() <= 8
        wait_for(lambda: (_closed(server.url, "evicted") or 0) >= 200 - 8, timeout=60,
                 what="evictions counted")
        assert _connection_threads() <= 8
        assert _closed(server.url, "refused") == 0
    finally:
        for sock in sockets:
            sock.close()
        _stop(server)


def test_at_the_limit_with_every_connection_busy_a_new_one_is_refused_with_503() -> None:
    release, inside = threading.Event(), threading.Event()

    def slow(payload) -> None:  # the first notification's handler holds its connection busy
        if not inside.is_set():
            inside.set()
            assert release.wait(60)

    server, _ = _serve(slow, max_connections=1, read_timeout=300.0)
    host, port = server.server_address[:2]
    body = json.dumps(notification()).encode()
    busy = socket.create_connection((host, port), timeout=60)
    try:
        busy.sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert inside.wait(30), "the first notification never reached the handler"
        with socket.create_connection((host, port), timeout=60) as sock:
            sock.sendall(b"GET /alerts HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        error = json.loads(payload)
        assert "--web.max-connections" in error["error"] and error["status"] == 503
        release.set()
        assert b"200 OK" in busy.recv(4096)
    finally:
        release.set()
        busy.close()
    wait_for(lambda: _closed(server.url, "refused") == 1, timeout=30, what="the refusal counted")
    _stop(server)


SHORT_BODY = b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"status\""


@pytest.mark.parametrize("sent", [b"", b"POST /alerts HTTP/1.1\r\nHost: x\r\n", SHORT_BODY],
                         ids=["idle", "half-sent", "short-body"])
def test_connection_without_a_complete_request_is_closed_after_the_read_timeout(sent) -> None:
    server, _ = _serve(read_timeout=0.5)
    try:
        with socket.create_connection(server.server_address[:2], timeout=60) as sock:
            opened = time.monotonic()
            sock.sendall(sent)
            assert sock.recv(4096) == b""  # the server closed it (blocks until then; 60 s socket limit)
            assert time.monotonic() - opened >= 0.5
        wait_for(lambda: _closed(server.url, "timeout") == 1, timeout=30, what="the timeout counted")
    finally:
        _stop(server)


def test_read_timeout_bounds_a_whole_request_not_each_read() -> None:
    """A client dripping a byte at a time cannot keep a connection past the read timeout."""
    server, _ = _serve(read_timeout=1.0)
    request = b"POST /alerts HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 2000 + b"\r\n\r\n"
    try:
        with socket.create_connection(server.server_address[:2], timeout=60) as sock:
            closed = False
            for byte in request:
                try:
                    sock.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                time.sleep(0.05)  # pacing of the drip (2,000 bytes: 100 s if never cut off)
            assert closed, "the dripping client was never cut off"
    finally:
        _stop(server)


def test_keep_alive_connection_serves_notifications_one_after_another() -> None:
    registry, out = CollectorRegistry(), io.StringIO()
    server = receiver.make_server("127.0.0.1", 0, receiver.NotificationLog(registry=registry, out=out),
                                  read_timeout=5.0, max_connections=1)
    server.serve_in_thread()
    try:
        with requests.Session() as session:
            for status in ("firing", "resolved", "firing"):
                session.post(server.url + "/alerts", json=notification(status), timeout=30).raise_for_status()
        assert [json.loads(line)["notification"]["status"] for line in out.getvalue().splitlines()] == [
            "firing", "resolved", "firing"]
        # Read from the registry, not over HTTP: a scrape is a second connection, and with a limit of one
        # it may evict the session's connection before the server has seen it close.
        assert registry.get_sample_value(CLOSED, {"reason": "evicted"}) == 0
    finally:
        _stop(server)


@pytest.mark.parametrize(("args", "message"), [
    (["--web.max-connections=0"], "--web.max-connections"),
    (["--web.max-connections=many"], "--web.max-connections"),
    (["--web.read-timeout=0s"], "--web.read-timeout"),
])
def test_bad_connection_limits_exit_2_with_one_line(args, message) -> None:
    result = subprocess.run([sys.executable, "-m", "gpuscope", "receiver", "--web.listen-address=127.0.0.1:0",
                             *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
