"""Slow, short and too many clients: read deadlines and a connection cap for the server's HTTP side.

aiohttp waits as long as a client likes for a request's line and headers (its keep-alive timer
only closes a connection after 75 s, and a request's first bytes do not stop it from waiting) and
for a body shorter than its ``Content-Length`` (forever); every such connection holds a socket.
:class:`LimitedRequestHandler`, the connection protocol the server runs, bounds all three:

- **headers**: from a connection's start, or the first byte of its next request on a kept-alive
  connection, the request line and headers must be in within ``header_timeout_s``; else the
  client gets ``408`` (JSON) and the connection closes;
- **body**: once the headers are in, the whole body within ``body_timeout_s``; else the handler's
  read raises :class:`BodyTimeout`, which the API answers with ``408``, and the connection closes;
- **connections**: at most ``max_connections`` at once. A new connection beyond the cap closes an
  idle kept-alive one at once, else the one that has waited longest for its request's headers; when
  every connection is answering a request, the new one gets ``503`` with ``Retry-After``.
- **descriptors**: an answered connection (408, 503) stays open ``LINGER_S`` for its client to read
  the answer, so sockets can outnumber the cap. The server's accept loop (``accept.py``) takes no
  connection while ``socket_cap`` sockets are open: ``max_connections`` plus ``SPARE_SOCKETS``.

Each close is counted in ``gpuscope_http_connections_closed_total{reason}``. An idle kept-alive
connection (no bytes of a next request) is left to aiohttp's keep-alive timer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from prometheus_client import Counter

from .http_settings import HttpLimits

log = logging.getLogger("gpuscope.server")

CLOSE_REASONS = ("header_timeout", "body_timeout", "evicted", "refused")
#: aiohttp's per-connection state the deadlines read (private, in every aiohttp 3.x tested here). An
#: aiohttp without them serves without the deadlines and cap, and the server says so at start.
_INTERNALS = ("_messages", "_request_count", "_request_in_progress", "_waiter", "_close", "_force_close",
              "_manager")
SUPPORTED = all(hasattr(RequestHandler, name) for name in _INTERNALS)
#: After answering a connection it closes (408, 503): how long its socket stays open for the client to
#: read the answer; closing at once with the client's bytes unread would reset it and lose the answer.
LINGER_S = 1.0
#: Sockets beyond ``max_connections`` the server may hold: connections answered 408 or 503 and
#: lingering, and ones just accepted over the cap whose eviction of another has not closed it yet.
SPARE_SOCKETS = 16


def socket_cap(limits: HttpLimits) -> int:
    """Sockets of client connections open at once at most: the accept loop stops taking more here."""
    return limits.max_connections + SPARE_SOCKETS


class BodyTimeout(RequestPayloadError):
    """The request's body did not arrive whole within the body deadline."""


def raw_json_response(status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 answer in the API's error shape, for a connection no route handles."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "param": None, "code": status}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close",
            *(f"{name}: {value}" for name, value in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class LimitedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with header and body deadlines and the connection cap."""

    limits: HttpLimits = HttpLimits()
    connections_closed: Counter | None = None
    #: Called once when the connection's socket has closed (the accept loop counts it out).
    on_closed: Callable[[], None] | None = None

    _deadline: asyncio.TimerHandle | None = None
    _deadline_kind: str | None = None  # "header" or "body" while a deadline runs
    _deadline_since = 0.0
    _pending_body: Any = None
    _answered = False

    # --- connection cap ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not SUPPORTED:
            return
        self._arm("header", self.limits.header_timeout_s)
        manager = self._manager
        if manager is None:
            return
        open_ = [h for h in manager.connections
                 if h.transport is not None and not getattr(h, "_answered", False)]
        if len(open_) <= self.limits.max_connections:
            return
        victim = _victim([h for h in open_ if h is not self])
        if victim is not None:
            victim._count("evicted")
            # At once: it sent nothing we owe an answer to, or only part of a request, and a lingering
            # socket would hold a descriptor the new connection needs.
            victim._disarm()
            victim.force_close()
            return
        self._count("refused")
        self._shut(raw_json_response(
            503, "Service Unavailable",
            f"too many connections (--web.max-connections={self.limits.max_connections}), all answering "
            "requests; retry", {"Retry-After": "1"}))

    def _idle(self) -> bool:
        """Waiting for a next request of which no byte has come (a kept-alive connection)."""
        waiter = self._waiter
        return (self._deadline_kind is None and waiter is not None and not waiter.done()
                and not self._request_in_progress)

    # --- deadlines -----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if not SUPPORTED:
            super().data_received(data)
            return
        if self._answered:
            return  # after our 408/503: read and dropped, so closing resets nothing
        before = self._request_count
        super().data_received(data)
        if self._force_close or self._close:
            self._disarm()
            return
        if self._request_count > before and self._messages:
            payload = self._messages[-1][1]  # the newest request's body
            if payload.is_eof():
                self._disarm()
            else:
                self._arm("body", self.limits.body_timeout_s)
                self._pending_body = payload  # after _arm, which forgets the last one
        elif self._deadline_kind == "body":
            if self._pending_body is None or self._pending_body.is_eof():
                self._disarm()
        elif self._deadline_kind is None and data:
            # The first bytes of a next request on a kept-alive connection: its headers' clock starts.
            self._arm("header", self.limits.header_timeout_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        try:
            super().connection_lost(exc)
        finally:
            on_closed, self.on_closed = self.on_closed, None
            if on_closed is not None:
                on_closed()

    def _arm(self, kind: str, seconds: float) -> None:
        self._disarm()
        self._deadline_kind, self._deadline_since = kind, self._loop.time()
        self._deadline = self._loop.call_later(seconds, self._expired, kind)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_kind, self._pending_body = None, None, None

    def _expired(self, kind: str) -> None:
        self._deadline = None
        if self.transport is None or self._answered:
            return
        if kind == "header":
            self._count("header_timeout")
            seconds = self.limits.header_timeout_s
            self._shut(raw_json_response(408, "Request Timeout",
                                         f"request line and headers not received within {seconds:g}s"))
        elif kind == "body" and self._pending_body is not None and not self._pending_body.is_eof():
            self._count("body_timeout")
            seconds = self.limits.body_timeout_s
            # The handler reading the body gets this and answers 408 (api.json_errors); the connection
            # closes after that answer, as after any broken body.
            self._pending_body.set_exception(BodyTimeout(f"request body not received within {seconds:g}s"))
            self._pending_body = None
            self._deadline_kind = None
            self.close()

    def _shut(self, answer: bytes | None) -> None:
        """Answer (when ``answer``), stop reading requests, and close after LINGER_S."""
        self._disarm()
        self._answered = True
        self._close = True
        transport = self.transport
        if transport is None:
            return
        if answer is not None and not self._request_in_progress:
            transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._loop.call_later(LINGER_S, self.force_close)

    def _count(self, reason: str) -> None:
        if self.connections_closed is not None:
            self.connections_closed.labels(reason).inc()
        log.debug("closing a connection from %s: %s", self.peername, reason)


def _victim(handlers: list[LimitedRequestHandler]) -> LimitedRequestHandler | None:
    """Which connection makes room for a new one: an idle kept-alive one first, else the one waiting
    longest for its request's headers; None when every one is answering or receiving a body."""
    idle = [h for h in handlers if isinstance(h, LimitedRequestHandler) and h._idle()]
    if idle:
        return idle[0]
    waiting = [h for h in handlers if isinstance(h, LimitedRequestHandler) and h._deadline_kind == "header"
               and not h._request_in_progress]
    return min(waiting, key=lambda h: h._deadline_since, default=None)
