"""gpuscope.logs.loki_push against a local receiver that checks Loki's documented push format.

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

from gpuscope.logs.loki_push import LokiHandler, push_url
from gpuscope.util.freeport import free_port
from tests.conftest import wait_for


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
        self.arrived = 0  # pushes received, including one held at the gate
        #: While set to a closed gate, a push is held (no answer) until the test opens it.
        self.gate: threading.Event | None = None
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
        self.arrived += 1
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.005)
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
        if self.gate is not None:
            self.gate.set()
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
    handler = LokiHandler(receiver.url, batch_size=10, batch_interval=3600, flush_timeout=30, registry=None)
    log = make_logger(handler, "batch")
    # The first full batch is held at the receiver while the rest is logged, so the next full batch
    # is waiting when the sender is free again: it must follow at once, and the remainder must not.
    receiver.gate = threading.Event()
    for i in range(10):
        log.info("line %d", i)
    wait_for(lambda: receiver.arrived == 1, what="a full batch pushed without waiting for the interval")
    for i in range(10, 25):
        log.info("line %d", i)
    receiver.gate.set()
    wait_for(lambda: len(receiver.entries) == 20, what="the second full batch right after the first")
    assert receiver.pushes == 2  # the 5 left over wait for the interval (an hour), or close
    started = time.monotonic()
    handler.close()
    # close() sends them at once: it neither waits for the interval nor runs out its flush time.
    assert time.monotonic() - started < handler.flush_timeout
    assert receiver.pushes == 3
    assert receiver.lines() == [f"line {i}" for i in range(25)]


def test_outage_costs_the_caller_nothing_counts_drops_and_resumes():
    # Loki first takes the connection and never answers: the sender is stuck in a push for as long
    # as the test holds it, so nothing the caller does meanwhile can have waited on the network.
    hole = socket.create_server(("127.0.0.1", 0))
    hole.settimeout(30)
    receiver = Receiver(port=hole.getsockname()[1])  # started later on the same port: Loki is back
    registry = CollectorRegistry()
    handler = LokiHandler(receiver.url, batch_size=20, batch_interval=0.05, max_buffer=50, timeout=3600,
                          backoff_initial=0.05, backoff_max=0.2, registry=registry)
    log = make_logger(handler, "outage")

    def metric(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels)

    try:
        for i in range(20):
            log.info("during outage %d", i)
        connection, _ = hole.accept()  # the sender holds a batch (20 records at most) in a push
        costs: list[float] = []

        def flood() -> None:
            for i in range(20, 500):
                t0 = time.thread_time()
                log.info("during outage %d", i)
                costs.append(time.thread_time() - t0)

        caller = threading.Thread(target=flood)
        caller.start()
        caller.join(60)
        assert not caller.is_alive(), "a log call waited on the push Loki never answers"
        # CPU time of the calling thread: what a call costs, however often a loaded machine pauses it.
        # A call that formatted, compressed or sent a batch itself would cost far more.
        mean, worst = sum(costs) / len(costs), max(costs)
        assert mean < 0.001 and worst < 0.1, f"mean {mean * 1e6:.0f} µs, worst {worst * 1e3:.1f} ms of CPU"
        dropped = metric("gpuscope_log_records_dropped_total", reason="queue_full")
        held = 500 - 50 - dropped  # the batch in the push: the buffer bound holds the rest
        assert 1 <= held <= 20
        assert metric("gpuscope_log_queue_records") == 50
        assert metric("gpuscope_log_push_failures_total") == 0  # still waiting for an answer

        # Loki goes down hard: the held push is cut off and reconnects are refused until it is back.
        hole.close()
        connection.close()
        wait_for(lambda: metric("gpuscope_log_push_failures_total") >= 2, timeout=30, what="retries")
        receiver.start()
        wait_for(lambda: metric("gpuscope_log_records_sent_total") == 500 - dropped, timeout=30,
                 what="the held batch and the buffer sent")
        assert metric("gpuscope_log_queue_records") == 0
        log.info("after outage")
        wait_for(lambda: "after outage" in receiver.lines(), timeout=30, what="sending resumed")
        # Everything not dropped arrived, oldest first, and nothing twice.
        kept = [f"during outage {i}" for i in range(500 - int(dropped))]
        assert receiver.lines() == [*kept, "after outage"]
        assert metric("gpuscope_log_records_sent_total") == len(receiver.entries)
        assert metric("gpuscope_log_queue_records") == 0
    finally:
        hole.close()
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
    # Loki takes the connection and never answers: only the flush deadline can end the push (its own
    # timeout is two minutes), so close() must cut it short and count what it could not send.
    hole = socket.create_server(("127.0.0.1", 0))
    registry = CollectorRegistry()
    handler = LokiHandler(f"http://127.0.0.1:{hole.getsockname()[1]}", batch_interval=60, timeout=120,
                          flush_timeout=0.5, backoff_initial=0.05, registry=registry)
    log = make_logger(handler, "shutdown")

    def shutdown_drops() -> float:
        return registry.get_sample_value("gpuscope_log_records_dropped_total", {"reason": "shutdown"})

    try:
        for i in range(30):
            log.warning("unsent %d", i)
        started = time.monotonic()
        handler.close()
        # close() waits for the flush deadline (plus a second for the sender to notice), never for
        # the push timeout; generous bounds, far below that timeout, for a loaded machine.
        assert time.monotonic() - started < 30
        wait_for(lambda: shutdown_drops() == 30, timeout=30, what="unsent records counted at the deadline")
        log.warning("after close")  # counted, never raises
        assert shutdown_drops() == 31
    finally:
        hole.close()


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
