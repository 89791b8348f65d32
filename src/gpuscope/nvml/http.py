"""HTTP endpoints: ``/metrics`` (Prometheus text, or OpenMetrics when asked), ``/`` and ``/healthz``.

A threaded server, so a slow client never holds up Prometheus. ``/metrics`` serves bytes the
exporter rendered in the background (``rendered.py``), so a scrape costs the same at 1 or 64
GPUs. Anything else answers 404 or 405 with a JSON body saying what exists.

Connections are bounded: at most ``max_connections`` at once (one thread each). At the limit a
new connection evicts the one that has waited longest for a request (idle keep-alive or
half-sent), so a scrape always gets in; with every connection busy answering, it waits up to a
second for one to finish, then gets a 503. Every request must arrive whole within
``read_timeout`` of the connection starting to wait for it (a client that sends nothing, stops
mid-request or trickles bytes is closed); the same timeout bounds writing the answer. Closed
connections are counted in ``gpuscope_exporter_http_connections_closed_total{reason}``, which
this server appends to every ``/metrics`` answer.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuscope.contract import catalogue as cat
from gpuscope.util.httpjson import JsonRequestHandler
from gpuscope.util.logsafe import quote

log = logging.getLogger("gpuscope.exporter")

_PAGE = b"""<!doctype html><html><head><title>gpuscope exporter</title></head><body>
<h1>gpuscope exporter</h1><p>NVML GPU metrics, sampled in the background.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li></ul>
</body></html>
"""
ENDPOINTS = ("/", "/metrics", "/healthz")
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_READ_TIMEOUT = 30.0  # seconds; Prometheus' keep-alive connections come back every scrape interval
#: At the limit with every connection answering: how long a new one waits for a slot before its 503.
BUSY_WAIT_S = 1.0
CLOSE_REASONS = ("refused", "evicted", "timeout")
_OPENMETRICS_EOF = b"# EOF\n"
#: content types whose rendering of the server's own metrics is kept (clients cannot grow the cache)
MAX_CACHED_FORMATS = 8


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    thread: threading.Thread
    waiting_since: float | None  # monotonic time it began waiting for a request; None while answering
    evicted: bool = False
    done: bool = False


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # listen backlog: where connections wait while the accept loop evicts

    def __init__(self, address: tuple[str, int], metrics: Callable[[str], tuple[bytes, str]],
                 health: Callable[[], dict], *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout: float = DEFAULT_READ_TIMEOUT,
                 closed_metric: cat.Metric = cat.EXPORTER_HTTP_CONNECTIONS_CLOSED) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be positive, not {read_timeout}")
        self.metrics = metrics  # Accept header → (body, content type)
        self.health = health
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self._cond = threading.Condition()
        self._connections: dict[socket.socket, _Connection] = {}
        # The server's own metrics, appended to every /metrics answer (the exporter renders the rest).
        self.own_registry = CollectorRegistry()
        # the exporter's name by default; another program serving through this class passes its own
        self.connections_closed = closed_metric.create(self.own_registry)
        for reason in CLOSE_REASONS:
            self.connections_closed.labels(reason)
        # Rendered once per content type and kept until a count changes (rendering even these three
        # series costs a third of a cached scrape).
        self._closed_version = 0
        self._count_lock = threading.Lock()  # a count and its version change together
        self._own_bodies: dict[str, tuple[int, bytes]] = {}
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="gpuscope-http", daemon=True)
        thread.start()
        return thread

    def metrics_body(self, accept: str) -> tuple[bytes, str]:
        """The exporter's exposition for this Accept header, with this server's own metrics at its end."""
        body, content_type = self.metrics(accept)
        encoder, own_type = choose_encoder(accept)
        if own_type != content_type:  # not the format the exporter chose: leave its answer alone
            return body, content_type
        if body.endswith(_OPENMETRICS_EOF):  # one exposition, one EOF, at its very end
            body = body[: -len(_OPENMETRICS_EOF)]
        return body + self._own_metrics(content_type, encoder), content_type

    def _own_metrics(self, content_type: str, encoder: Callable) -> bytes:
        version = self._closed_version  # read first: a count during the render makes the next one fresh
        cached = self._own_bodies.get(content_type)
        if cached is not None and cached[0] == version:
            return cached[1]
        body = encoder(self.own_registry)
        if content_type in self._own_bodies or len(self._own_bodies) < MAX_CACHED_FORMATS:
            self._own_bodies[content_type] = (version, body)
        return body

    # --- connection bookkeeping (the accept loop's thread and the connections' threads) -------------

    def process_request(self, request, client_address) -> None:  # the accept loop's thread
        if not self._admit():
            self._refuse(request)
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="gpuscope-http-conn", daemon=True)
        with self._cond:
            self._connections[request] = _Connection(request, thread, time.monotonic())
        thread.start()

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._cond:
                connection = self._connections.get(request)
                if connection is not None:
                    connection.done = True
                self._cond.notify_all()

    def _reap(self) -> None:
        """Forget finished connections (called with the lock held); a slot frees once its thread is gone."""
        for sock, connection in list(self._connections.items()):
            if connection.done:
                connection.thread.join()  # past its last statement: returns at once
                del self._connections[sock]

    def _admit(self) -> bool:
        """Whether a new connection gets a slot: evict the longest-waiting one at the limit if needed."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            with self._cond:
                self._reap()
                if len(self._connections) < self.max_connections:
                    return True
                waiting = [c for c in self._connections.values()
                           if c.waiting_since is not None and not c.evicted and not c.done]
                victim = min(waiting, key=lambda c: c.waiting_since, default=None)
                if victim is None:  # every connection is answering: they finish quickly
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(remaining)
                    continue
                victim.evicted = True
            self.count_closed("evicted")
            with contextlib.suppress(OSError):
                victim.sock.shutdown(socket.SHUT_RDWR)  # its blocked read returns at once
            victim.thread.join(self.read_timeout)

    def _refuse(self, request: socket.socket) -> None:
        self.count_closed("refused")
        body = json.dumps({"error": f"too many connections (--web.max-connections={self.max_connections}), "
                                    "all busy; retry"}).encode() + b"\n"
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)
            # Take what the client sent: closing with unread data would reset the connection, and the
            # client could lose the answer.
            with contextlib.suppress(BlockingIOError, InterruptedError):
                request.recv(65536)
            request.send(head + body)
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    def count_closed(self, reason: str) -> None:
        with self._count_lock:  # from the accept loop and connection threads at once
            self.connections_closed.labels(reason).inc()
            self._closed_version += 1

    def connection_waiting(self, sock: socket.socket) -> None:
        with self._cond:
            connection = self._connections.get(sock)
            if connection is not None:
                connection.waiting_since = time.monotonic()
                self._cond.notify_all()  # an accept loop waiting for a slot may evict it now

    def connection_answering(self, sock: socket.socket) -> None:
        with self._cond:
            connection = self._connections.get(sock)
            if connection is not None:
                connection.waiting_since = None

    def handle_error(self, request, client_address) -> None:
        # A client that resets or vanishes mid-answer: not worth socketserver's traceback on stderr.
        log.debug("http: connection from %s ended with an error", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        with self._cond:
            open_connections = list(self._connections.values())
        for connection in open_connections:  # wake their threads: a read sees the shutdown at once
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)


class _DeadlineReader(io.RawIOBase):
    """The request side of a connection: every read waits only until the handler's deadline."""

    def __init__(self, handler: _Handler) -> None:
        self._handler = handler
        self._sock: socket.socket = handler.connection

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        remaining = self._handler.deadline - time.monotonic()
        if remaining <= 0:
            self._handler.timed_out = True
            raise TimeoutError("no complete request within the read timeout")
        self._sock.settimeout(remaining)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            self._handler.timed_out = True
            raise


class _Handler(JsonRequestHandler):
    server: ExporterServer
    malformed_log = log
    # Headers and body go out in two writes; with Nagle on, the second waits for a delayed ACK
    # (up to 40 ms on Linux) on keep-alive connections, which is what Prometheus uses.
    disable_nagle_algorithm = True

    deadline = 0.0  # monotonic time by which the current request must have arrived whole
    timed_out = False

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain socket reader: requests are read through the deadline instead
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.server.read_timeout
        self.server.connection_waiting(self.connection)
        super().handle_one_request()  # a TimeoutError ends the connection there (close_connection)
        if self.timed_out:
            self.server.count_closed("timeout")

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:  # request line and headers are in: answering from here on
            self.server.connection_answering(self.connection)
            self.connection.settimeout(self.server.read_timeout)  # bounds writing the answer
        return ok

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, content_type = self.server.metrics_body(self.headers.get("Accept", ""))
            self.send_body(200, body, content_type)
        elif path == "/healthz":
            self.send_json(200, self.server.health())
        elif path == "/":
            self.send_body(200, _PAGE, "text/html; charset=utf-8")
        else:
            self.send_json_error(404, f"no such path: {path}", endpoints=list(ENDPOINTS))

    def do_HEAD(self) -> None:
        self.do_GET()

    def _method_not_allowed(self) -> None:
        self.close_connection = True  # the request body is not read
        self.send_json_error(405, f"method {self.command} not allowed", headers={"Allow": "GET, HEAD"},
                             allowed=["GET", "HEAD"])

    do_POST = do_PUT = do_DELETE = do_PATCH = _method_not_allowed

    def log_message(self, format: str, *args: object) -> None:
        if log.isEnabledFor(logging.DEBUG):  # the request line is the client's text: escaped, bounded
            log.debug("http: %s", quote(format % args, 300))
