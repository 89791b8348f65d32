"""A threaded HTTP server whose connections are bounded in number and in time, for the standard
library's servers (the exporter's, the share controller's and the alert receiver's).

At most ``max_connections`` at once (one thread each). At the limit a new connection evicts the one
that has waited longest for a request (idle keep-alive or half-sent), so a scrape or a notification
always gets in; with every connection busy answering, it waits up to a second for one to finish,
then gets a 503. Every request must arrive whole, body included, within ``read_timeout`` of the
connection starting to wait for it (a client that sends nothing, stops mid-request or trickles
bytes is closed); the same timeout bounds writing the answer. The listen backlog is a normal one
(128), where connections wait while the accept loop evicts. Closed connections are counted in a
``{reason}`` counter (refused, evicted, timeout) that each program names in the catalogue.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue as cat
from gpuscope.util.flags import parse_duration
from gpuscope.util.httpjson import JsonRequestHandler
from gpuscope.util.settings import setting

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_READ_TIMEOUT = 30.0  # seconds; Prometheus' keep-alive connections come back every scrape interval
#: At the limit with every connection answering: how long a new one waits for a slot before its 503.
BUSY_WAIT_S = 1.0
CLOSE_REASONS = ("refused", "evicted", "timeout")
#: Name of each connection's thread (tests count them).
CONNECTION_THREAD = "gpuscope-http-conn"


def parse_max_connections(text: str) -> int:
    """``--web.max-connections``: a whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{text!r} is not a whole number of at least 1")
    return int(text)


# The two limits' flags, declared once for the commands whose servers run one thread a connection (the
# exporter and the alert receiver), so that their names, parsing and help say the same thing.

def max_connections_setting() -> Any:
    """The ``--web.max-connections`` settings field: how many connections at once."""
    return setting(
        "--web.max-connections", DEFAULT_MAX_CONNECTIONS, "most HTTP connections at once, one thread each; "
        "at the limit the one waiting longest for a request is closed, or with all busy the new one gets a "
        f"503 (default {DEFAULT_MAX_CONNECTIONS})", parse=parse_max_connections, metavar="N")


def read_timeout_setting(default: float = DEFAULT_READ_TIMEOUT, *, body_included: bool = False) -> Any:
    """The ``--web.read-timeout`` settings field; ``body_included`` says so in the help (a server that
    takes request bodies)."""
    request = "each whole request, body included," if body_included else "each whole request"
    return setting(
        "--web.read-timeout", default, f"a connection must deliver {request} within this (idle keep-alive "
        f"time included), else it is closed (default {default:g}s)", parse=parse_duration, metavar="DURATION")


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    thread: threading.Thread
    waiting_since: float | None  # monotonic time it began waiting for a request; None while answering
    evicted: bool = False
    done: bool = False


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with the limits above; its handler derives from :class:`DeadlineHandler`."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # listen backlog: where connections wait while the accept loop evicts

    def __init__(self, address: tuple[str, int], handler: type[DeadlineHandler], *, max_connections: int,
                 read_timeout: float, closed_metric: cat.Metric, registry: CollectorRegistry) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        if not read_timeout > 0:
            raise ValueError(f"read_timeout must be positive, not {read_timeout}")
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self._cond = threading.Condition()
        self._connections: dict[socket.socket, _Connection] = {}
        self.connections_closed = closed_metric.create(registry)
        for reason in CLOSE_REASONS:
            self.connections_closed.labels(reason)
        super().__init__(address, handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="gpuscope-http", daemon=True)
        thread.start()
        return thread

    def count_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    # --- connection bookkeeping (the accept loop's thread and the connections' threads) -------------

    def process_request(self, request, client_address) -> None:  # the accept loop's thread
        if not self._admit():
            self._refuse(request)
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name=CONNECTION_THREAD, daemon=True)
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
                                    "all busy; retry", "status": 503}).encode() + b"\n"
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

    def server_close(self) -> None:
        super().server_close()
        with self._cond:
            open_connections = list(self._connections.values())
        for connection in open_connections:  # wake their threads: a read sees the shutdown at once
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)


class _DeadlineReader(io.RawIOBase):
    """The request side of a connection: every read waits only until the handler's deadline."""

    def __init__(self, handler: DeadlineHandler) -> None:
        self._handler = handler
        self._sock: socket.socket = handler.connection

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
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


class BadRequest(Exception):
    """Input a server refuses; carries the HTTP status to answer with."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class DeadlineHandler(JsonRequestHandler):
    """Reads each request (line, headers and body) against one deadline; tells the server when a
    connection waits for a request (evictable) and when it answers (not)."""

    server: BoundedHTTPServer
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
        # A TimeoutError (request line, headers, or a body a route reads) ends the connection there.
        super().handle_one_request()
        if self.timed_out:
            self.server.count_closed("timeout")

    def read_body(self, max_bytes: int) -> bytes:
        """The request's body, whole, within the request's deadline (BadRequest without a usable
        Content-Length or past ``max_bytes``: the connection then closes, its unread body must not be
        parsed as the next request)."""
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        try:
            length = int(raw)
        except ValueError:
            self.close_connection = True
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"Content-Length {raw!r} is not a number") from None
        if length < 0 or length > max_bytes:
            self.close_connection = True
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"body of {length} bytes is over the limit of {max_bytes}")
        return self.rfile.read(length)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:  # request line and headers are in: answering from here on
            self.server.connection_answering(self.connection)
            self.connection.settimeout(self.server.read_timeout)  # bounds writing the answer
        return ok
