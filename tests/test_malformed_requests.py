"""The exporter's and the alert receiver's HTTP servers on request lines they cannot take.

Each malformed line gets a JSON error with a status line and headers (HTTP/0.9 and garbage got
nothing before: the standard library takes them for HTTP/0.9 and writes no head), the connection
closes, and the server logs one INFO line with the client's text escaped and bounded.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuscope.nvml.http import ExporterServer
from gpuscope.receiver import main as receiver
from gpuscope.util.freeport import free_port
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]

#: (what the client sends, status, words of the error message)
MALFORMED = [
    pytest.param(b"GET /metrics\r\n", 400, "HTTP/0.9", id="http-0.9"),
    pytest.param(b"GET /metrics\r\n\r\n", 400, "HTTP/0.9", id="http-0.9-blank-line"),
    pytest.param(b"POST /alerts\r\n", 400, "HTTP/0.9", id="http-0.9-post"),
    pytest.param(b"GET /metrics HTTP/1.x\r\n\r\n", 400, "Bad request version", id="bad-version"),
    pytest.param(b"GET /metrics HTTPS/1.1\r\n\r\n", 400, "Bad request version", id="not-http"),
    pytest.param(b"GET /metrics HTTP/2.0\r\n\r\n", 505, "Invalid HTTP version", id="http-2"),
    pytest.param(b"garbage\r\n\r\n", 400, "Bad request syntax", id="one-word"),
    pytest.param(b"GET /a b HTTP/1.1\r\n\r\n", 400, "Bad request syntax", id="four-words"),
    pytest.param(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", 400, "Bad request syntax",
                 id="tls-hello"),
    pytest.param(b"GET /metrics HTTP/1.1\nX: \x1b[31m\r\n" + b"Y" * 70000 + b"\r\n\r\n", 431, "Line too long",
                 id="header-too-long"),
    pytest.param(b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414, "URI Too Long", id="line-too-long"),
]


def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, then read until the server closes the connection (it must, after an error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _check_answer(reply: bytes, status: int, words: str) -> dict:
    head, sep, body = reply.partition(b"\r\n\r\n")
    assert sep, f"no HTTP head in the answer: {reply[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), lines[0]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    error = json.loads(body)
    assert error["status"] == status and words in error["error"], error
    return error


@pytest.fixture
def exporter_port() -> Iterator[int]:
    server = ExporterServer(("127.0.0.1", 0), lambda accept: (b"up 1\n", "text/plain"), lambda: {"ok": 1},
                            read_timeout=10)
    server.serve_in_thread()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def receiver_port() -> Iterator[int]:
    server = receiver.make_server("127.0.0.1", 0, receiver.NotificationLog(out=io.StringIO()),
                                  read_timeout=10)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("sent, status, words", MALFORMED)
@pytest.mark.parametrize("part, logger", [("exporter", "gpuscope.exporter"),
                                          ("receiver", "gpuscope.receiver")])
def test_malformed_request_line_gets_a_json_error_and_one_info_line(request, caplog, part, logger, sent,
                                                                     status, words):
    port = request.getfixturevalue(f"{part}_port")
    with caplog.at_level(logging.INFO, logger=logger):
        _check_answer(_exchange(port, sent), status, words)
        records = wait_for(lambda: [r for r in caplog.records
                                    if r.name == logger and r.levelno >= logging.INFO],
                           timeout=10, what="the malformed request's log line")
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in records] == [
        (logging.INFO, f"malformed HTTP request from 127.0.0.1, answered {status}")]
    message = records[0].getMessage()
    assert "\n" not in message and "\x1b" not in message and "\r" not in message
    assert len(message) < 400  # the client's text is bounded, whatever it sent


@pytest.mark.parametrize("part", ["exporter", "receiver"])
def test_a_good_request_still_works_after_malformed_ones(request, part):
    port = request.getfixturevalue(f"{part}_port")
    for sent in (b"GET /healthz\r\n", b"garbage\r\n\r\n"):
        _exchange(port, sent)
    reply = _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ")


def test_receiver_closes_a_connection_that_stops_mid_request():
    server = receiver.make_server("127.0.0.1", 0, receiver.NotificationLog(out=io.StringIO()),
                                  read_timeout=0.5)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        port = server.server_address[1]
        # A body shorter than its Content-Length: the receiver must not wait for the rest forever.
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"status\"")
            assert sock.recv(65536) == b""  # closed by the receiver, long before our 30 s
    finally:
        server.shutdown()
        server.server_close()


def test_receiver_command_logs_one_line_per_malformed_request_and_no_traceback(tmp_path):
    port = free_port()
    err = tmp_path / "receiver.err"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with err.open("w") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "gpuscope", "receiver", "--web.listen-address",
                                  f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        wait_for(lambda: "listening on" in err.read_text() or child.poll() is not None, timeout=60,
                 what="the receiver listening")
        sent = [b"GET /alerts\r\n", b"garbage\r\n\r\n", b"GET / HTTP/1.x\r\n\r\n",
                b"GET / HT\nTP/1.1 \x1b[2J\r\n\r\n"]
        for data in sent:
            assert _exchange(port, data).startswith(b"HTTP/1.1 400 ")
        lines = wait_for(lambda: [line for line in err.read_text().splitlines() if "malformed" in line]
                         if err.read_text().count("malformed") >= len(sent) else None, timeout=10,
                         what="one line per malformed request")
        assert len(lines) == len(sent) and all(" level=INFO msg=malformed HTTP request" in line
                                               for line in lines), lines
        text = err.read_text()
        assert "Traceback" not in text and "\x1b" not in text, text
    finally:
        child.terminate()
        child.wait(timeout=30)
