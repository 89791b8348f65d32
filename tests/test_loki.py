"""gpuscope.loki against a local receiver that checks Loki's documented push format.

Loki's ``POST /loki/api/v1/push`` takes ``{"streams": [{"stream": {label: value},
"values": [["<unix ns as string>", "<line>", {metadata}]]}]}``; the third
element (structured metadata, Loki 3.x) is an object of string values; gzip
bodies carry ``Content-Encoding: gzip``. The receiver answers 400 to anything
else, as Loki would, and records what it accepted.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from gpuscope.loki import LokiHandler, push_url
from tests.conftest import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_push(headers, raw: bytes) -> list[tuple[dict, list]]:
    """The streams of a valid push; raises ValueError naming what is wrong."""
    if headers.get("Content-Encoding") != "gzip":
        raise ValueError("Content-Encoding is not gzip")
    if not headers.get("Content-Type", "").startswith("application/json"):
        raise ValueError("Content-Type is not application/json")
    body = json.loads(gzip.decompress(raw))
    if set(body) != {"streams"} or not isinstance(body["streams"], list):
        raise ValueError("top level must be {'streams': [...]}")
    out = []
    for stream in body["streams"]:
        labels, values = stream["stream"], stream["values"]
        if not labels or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise ValueError("stream labels must be a non-empty object of strings")
        for value in values:
            if len(value) not in (2, 3) or not isinstance(value[0], str) or not value[0].isdigit():
                raise ValueError(f"value {value!r}: timestamp must be a string of unix nanoseconds")
            if not isinstance(value[1], str):
                raise ValueError("line must be a string")
            if len(value) == 3 and not (isinstance(value[2], dict)
                                        and all(isinstance(v, str) for v in value[2].values())):
                raise ValueError("structured metadata must be an object of string values")
        out.append((labels, values))
    return out


class Receiver:
    """A Loki push endpoint on 127.0.0.1:port that can be stopped and started again."""

    def __init__(self, port: int | None = None, status: int = 204) -> None:
        self.port = port or free_port()
        self.status = status
        self.entries: list[tuple[dict, list]] = []
        self.pushes = 0
        self.invalid: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lines(self) -> list[str]:
        return [value[1] for _, value in self.entries]

    async def _push(self, request):
        from aiohttp import web

        raw = await request.read()
        try:
            streams = check_push(request.headers, raw)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            self.invalid.append(str(exc))
            return web.json_response({"message": str(exc)}, status=400)
        if self.status >= 300:
            return web.Response(status=self.status, text="nope")
        self.pushes += 1
        for labels, values in streams:
            self.entries.extend((labels, value) for value in values)
        return web.Response(status=204)

    def start(self) -> Receiver:
        from aiohttp import web

        ready = threading.Event()

        def run():
            loop = self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/loki/api/v1/push", self._push)
            # auto_decompress off: the receiver must see the gzip bytes the handler really sent.
            runner = web.AppRunner(app, access_log=None, auto_decompress=False)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = self._thread = None


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def make_logger(handler: logging.Handler, name: str) -> logging.Logger:
    logger = logging.getLogger(f"test.loki.{name}")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    return logger


def test_push_format_labels_and_structured_metadata(receiver):
    registry = CollectorRegistry()
    handler = LokiHandler(receiver.url, service="svc", instance="host:1", batch_interval=0.05,
                          registry=registry)
    log = make_logger(handler, "format")
    before = time.time_ns()
    extra = {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "tenant": "alpha"}
    log.info('{"event": "request"}', extra=extra)
    log.error("boom")
    wait_for(lambda: len(receiver.entries) == 2, what="2 entries pushed")
    handler.close()
    assert receiver.invalid == []
    (labels, first), (_, second) = receiver.entries
    assert labels == {"service": "svc", "instance": "host:1"}  # request fields never become labels
    assert before <= int(first[0]) <= time.time_ns()
    assert first[1] == '{"event": "request"}'
    assert first[2] == {"level": "info", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "tenant": "alpha"}
    assert second[1:] == ["boom", {"level": "error"}]
    assert registry.get_sample_value("gpuscope_log_records_sent_total") == 2
    assert registry.get_sample_value("gpuscope_log_records_dropped_total", {"reason": "queue_full"}) == 0


def test_full_batches_go_at_once_and_close_flushes_the_rest(receiver):
    handler = LokiHandler(receiver.url, batch_size=10, batch_interval=60, registry=None)
    log = make_logger(handler, "batch")
    for i in range(25):
        log.info("line %d", i)
    wait_for(lambda: len(receiver.entries) == 20, what="two full batches without waiting for the interval")
    assert receiver.pushes == 2
    started = time.monotonic()
    handler.close()
    assert time.monotonic() - started < 2
    assert receiver.lines() == [f"line {i}" for i in range(25)]


def test_outage_costs_the_caller_nothing_counts_drops_and_resumes():
    receiver = Receiver()  # port chosen, nothing listening yet: Loki is down
    registry = CollectorRegistry()
    handler = LokiHandler(receiver.url, batch_size=20, batch_interval=0.05, max_buffer=50,
                          backoff_initial=0.05, backoff_max=0.2, registry=registry)
    log = make_logger(handler, "outage")
    worst, total = 0.0, 0.0
    for i in range(500):
        t0 = time.perf_counter()
        log.info("during outage %d", i)
        took = time.perf_counter() - t0
        worst, total = max(worst, took), total + took
    # A call that waited on the network would take the push timeout (5 s) or a backoff; bounds far
    # below those, loose enough for a GIL switch on a busy 2-core CI machine.
    assert total / 500 < 0.001 and worst < 0.1, f"mean {total / 500 * 1e6:.0f} µs, worst {worst * 1e3:.1f} ms"
    dropped = registry.get_sample_value("gpuscope_log_records_dropped_total", {"reason": "queue_full"})
    assert 500 - 50 - 20 <= dropped <= 500 - 50  # the buffer bound, plus one batch the sender holds
    wait_for(lambda: registry.get_sample_value("gpuscope_log_push_failures_total") >= 2, what="retries")
    receiver.start()  # Loki is back
    try:
        log.info("after outage")
        wait_for(lambda: "after outage" in receiver.lines(), timeout=10, what="sending resumed")
        assert len(receiver.entries) == 500 - dropped + 1  # everything not dropped arrived
        assert registry.get_sample_value("gpuscope_log_records_sent_total") == len(receiver.entries)
        assert registry.get_sample_value("gpuscope_log_queue_records") == 0
    finally:
        handler.close()
        receiver.stop()


def test_rejected_push_is_dropped_and_counted_not_retried():
    receiver = Receiver(status=400).start()
    registry = CollectorRegistry()
    handler = LokiHandler(receiver.url, batch_interval=0.05, registry=registry)
    try:
        make_logger(handler, "rejected").info("refused")
        wait_for(lambda: registry.get_sample_value("gpuscope_log_records_dropped_total",
                                                   {"reason": "rejected"}) == 1, what="rejected drop")
        assert registry.get_sample_value("gpuscope_log_push_failures_total") == 0
    finally:
        handler.close()
        receiver.stop()


def test_close_with_loki_down_returns_within_flush_timeout():
    registry = CollectorRegistry()
    handler = LokiHandler(f"http://127.0.0.1:{free_port()}", batch_interval=60, flush_timeout=0.5,
                          backoff_initial=0.05, registry=registry)
    log = make_logger(handler, "shutdown")
    for i in range(30):
        log.warning("unsent %d", i)
    started = time.monotonic()
    handler.close()
    assert time.monotonic() - started < 1.5
    assert registry.get_sample_value("gpuscope_log_records_dropped_total", {"reason": "shutdown"}) == 30
    log.warning("after close")  # counted, never raises
    assert registry.get_sample_value("gpuscope_log_records_dropped_total", {"reason": "shutdown"}) == 31


def test_push_url_and_two_line_setup(receiver):
    assert push_url("http://loki:3100/") == "http://loki:3100/loki/api/v1/push"
    assert push_url("http://loki:3100/loki/api/v1/push") == "http://loki:3100/loki/api/v1/push"
    root = logging.getLogger()
    handler = LokiHandler(receiver.url, service="my-app", registry=CollectorRegistry(), batch_interval=0.05)
    root.addHandler(handler)
    try:
        logging.getLogger("some.library").warning("from anywhere")
        wait_for(lambda: "from anywhere" in receiver.lines(), what="root-logger record shipped")
    finally:
        root.removeHandler(handler)
        handler.close()
