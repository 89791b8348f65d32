"""``gpuscope serve`` as a process against hostile or broken clients.

Oversized or malformed HTTP gets the API's JSON error shape with a 4xx status; a client that hangs
up mid-body is counted, not logged as a server error; neither writes an ERROR line or a traceback
(the Loki error-burst rule counts ERROR lines). SIGTERM exits 0 with nothing printed after shutdown.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import struct
import sys
import uuid
import weakref
from pathlib import Path

import pytest
import requests

from gpuscope.contract import catalogue as cat
from gpuscope.ops import procs
from tests.conftest import wait_for
from tests.logs.test_loki_push import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
SMALL = ["--model.layers", "1", "--model.dim", "64", "--model.context", "256", "--request.max-tokens", "32"]
CLIENT_ERRORS = cat.HTTP_CLIENT_ERRORS.name
#: Log lines that would page someone: ERROR records, tracebacks, aiohttp's own error report.
ALARMING = re.compile(r" ERROR |Traceback|Error handling request|Exception ignored")


class ServeProcess:
    def __init__(self, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child = procs.Child([sys.executable, "-m", "gpuscope", "serve", *SMALL, "--web.listen-address",
                                  f"127.0.0.1:{self.port}", *args], env=ENV, log_path=log_path,
                                 ready=self.url + "/readyz", grace_s=60).start()
        self.child.wait_ready(120)

    def log(self) -> str:
        return self.child.output()

    def synced_log(self) -> str:
        """The log once everything before this call has been written: a request whose line we wait for."""
        trace_id = uuid.uuid4().hex
        headers = {"traceparent": f"00-{trace_id}-{'1' * 16}-01"}
        r = requests.post(self.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        wait_for(lambda: trace_id in self.log(), timeout=30, what="the marker request's log line")
        return self.log()

    def metric(self, name: str, **labels: str) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def stop(self) -> int | None:
        return self.child.stop()


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    server = ServeProcess(tmp_path_factory.mktemp("serve") / "serve.log", "--log.level", "info")
    yield server
    server.stop()


def raw_exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read until the server closes; (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        # The server may answer and close before taking everything: read its answer all the same.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


MALFORMED = {
    "64 KiB header": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n", 431),
    "8 KiB URL": (b"GET /" + b"a" * 8192 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    "2,000 headers": (b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                      + b"".join(b"X-H%d: v\r\n" % i for i in range(2000)) + b"\r\n", 431),
    "bad Content-Length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    "bad request line": (b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n", 400),
    "bad chunk size": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"zz\r\n", 400),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_http_gets_a_json_4xx(serve, case):
    data, expected = MALFORMED[case]
    status, headers, body = raw_exchange(serve.port, data)
    assert status == expected, body
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error" and error["message"]
    assert len(error["message"]) <= 300


def test_malformed_http_is_counted_not_logged_as_an_error(serve):
    before = serve.metric(CLIENT_ERRORS, reason="malformed")
    for data, _ in MALFORMED.values():
        raw_exchange(serve.port, data)
    log = serve.synced_log()
    assert not ALARMING.search(log), log
    assert before is not None, f"{CLIENT_ERRORS}{{reason='malformed'}} is not exposed"
    assert serve.metric(CLIENT_ERRORS, reason="malformed") == before + len(MALFORMED)


def _expect_continue(port: int, extra_headers: bytes = b"") -> socket.socket:
    """A completion request whose handler is reading the body: the server has sent 100 Continue."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n" + extra_headers)
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(4096)
        assert chunk, "closed before 100 Continue"
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 100"), reply
    return sock


@pytest.mark.parametrize("how", ["close", "reset"])
def test_client_hanging_up_mid_body_is_counted_not_an_error(serve, how):
    before = serve.metric(CLIENT_ERRORS, reason="disconnect")
    assert before is not None, f"{CLIENT_ERRORS}{{reason='disconnect'}} is not exposed"
    sock = _expect_continue(serve.port, b"Content-Length: 1000\r\n\r\n")
    sock.sendall(b'{"prompt": "' + b"a" * 100)
    if how == "reset":  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    wait_for(lambda: serve.metric(CLIENT_ERRORS, reason="disconnect") == before + 1, timeout=30,
             what="the disconnect counted")
    log = serve.synced_log()
    assert not ALARMING.search(log), log


def test_broken_body_encoding_is_a_json_400_and_counted(serve):
    before = serve.metric(CLIENT_ERRORS, reason="bad_body")
    body = b"this is not gzip" * 4
    status, headers, answer = raw_exchange(serve.port, (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)) + body)
    assert status == 400, answer
    assert headers["content-type"].startswith("application/json")
    assert json.loads(answer)["error"]["message"].startswith("request body is malformed")
    log = serve.synced_log()
    assert not ALARMING.search(log), log
    assert before is not None, f"{CLIENT_ERRORS}{{reason='bad_body'}} is not exposed"
    assert serve.metric(CLIENT_ERRORS, reason="bad_body") == before + 1


def test_broken_body_on_a_route_that_does_not_read_it_is_not_an_error(serve):
    """405 without reading the body; aiohttp then drains it ("lingering") and meets the broken gzip."""
    body = b"this is not gzip" * 4
    status, _, answer = raw_exchange(serve.port, (
        b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)) + body)
    assert status == 405 and json.loads(answer)["error"]["code"] == 405
    log = serve.synced_log()
    assert not ALARMING.search(log), log


def _responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP responses in ``data``, one after another (each with a Content-Length)."""
    responses = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"a cut response head: {data[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers["content-length"])
        responses.append((int(lines[0].split()[1]), headers, rest[:length]))
        data = rest[length:]
    return responses


#: Cheap routes with distinct answers, so that the answers' order shows the requests'.
PIPELINED = {"/healthz": {"status": "ok"}, "/readyz": {"status": "ready"}, "/v1/models": None}


@pytest.mark.parametrize(("bad", "count"), [(10, 20), (35, 40)], ids=["10th-of-20", "35th-past-the-queue"])
def test_requests_pipelined_before_a_malformed_one_are_answered_in_order_then_the_error(serve, bad, count):
    """One write of ``count`` pipelined GETs whose ``bad``-th has a 9 kB header: the ones before it are
    answered in order, then it gets the JSON 431, then the connection closes. The second case sends
    more than the connection queues at once (32), so the bad one is parsed after the queue drained."""
    paths = [list(PIPELINED)[i % len(PIPELINED)] for i in range(count)]
    big = b"X-Big: " + b"a" * 9000 + b"\r\n"
    sent = b"".join(b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path.encode(), big if i == bad - 1 else b"")
                    for i, path in enumerate(paths))
    with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as sock:
        sock.sendall(sent)
        chunks = []
        while chunk := sock.recv(65536):  # until the server closes
            chunks.append(chunk)
    answers = _responses(b"".join(chunks))
    assert [status for status, _, _ in answers] == [200] * (bad - 1) + [431]
    for path, (_, _, body) in zip(paths[:bad - 1], answers[:-1], strict=True):
        answer = json.loads(body)
        assert answer == PIPELINED[path] or (PIPELINED[path] is None and answer["object"] == "list"), path
    _, headers, body = answers[-1]
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == 431 and "header field is longer than" in error["message"]
    log = serve.synced_log()
    assert not ALARMING.search(log), log


def test_sigterm_after_traffic_exits_0_and_prints_nothing_after_shutdown(tmp_path):
    server = ServeProcess(tmp_path / "serve.log")
    for _ in range(3):
        r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    assert server.stop() == 0
    log = server.log()
    assert not ALARMING.search(log), log


def test_logging_handlers_close_twice_and_survive_logging_shutdown():
    """main's finally closes the handlers, then logging's atexit shutdown closes them again."""
    from prometheus_client import CollectorRegistry

    from gpuscope.server.config import ServerConfig
    from gpuscope.server.main import setup_logging

    root = logging.getLogger("gpuscope")
    before = list(root.handlers), root.level
    handlers = setup_logging(ServerConfig(), "info", CollectorRegistry())
    try:
        logging.getLogger("gpuscope.server.test").info("through the queue")
        for handler in handlers:
            handler.close()
        for handler in handlers:
            handler.close()
        logging.shutdown(handlerList=[weakref.ref(h) for h in handlers])  # what atexit runs
    finally:
        for handler in list(root.handlers):
            if handler not in before[0]:
                root.removeHandler(handler)
        root.setLevel(before[1])
