"""A program's ``/metrics`` (Prometheus text, or OpenMetrics when asked), ``/`` and ``/healthz``:
the NVML exporter's and the share controller's.

A threaded server, so a slow client never holds up Prometheus. ``/metrics`` serves what the
program's ``metrics`` callable renders (the exporter renders in the background, so a scrape costs the
same at 1 or 64 GPUs). Anything else answers 404 or 405 with a JSON body saying what exists.

Connections are bounded in number and time (``util/bounded_http.py``). Closed connections are
counted in the program's ``{reason}`` counter, which this server appends to every ``/metrics`` answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuscope.contract import catalogue as cat
from gpuscope.util.bounded_http import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    BoundedHTTPServer,
    DeadlineHandler,
)
from gpuscope.util.logsafe import quote

log = logging.getLogger("gpuscope.http")


def page(title: str, about: str) -> bytes:
    """The ``/`` page: what the program is, and links to its endpoints."""
    return (f"<!doctype html><html><head><title>{title}</title></head><body>\n"
            f"<h1>{title}</h1><p>{about}</p>\n"
            '<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li></ul>\n'
            "</body></html>\n").encode()


ENDPOINTS = ("/", "/metrics", "/healthz")
_OPENMETRICS_EOF = b"# EOF\n"
#: content types whose rendering of the server's own metrics is kept (clients cannot grow the cache)
MAX_CACHED_FORMATS = 8


class MetricsServer(BoundedHTTPServer):
    """A program's endpoints on a bounded server, its closed-connection counts on its /metrics."""

    def __init__(self, address: tuple[str, int], metrics: Callable[[str], tuple[bytes, str]],
                 health: Callable[[], dict], *, page: bytes, closed_metric: cat.Metric,
                 log: logging.Logger = log, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
        self.metrics = metrics  # Accept header → (body, content type)
        self.health = health
        self.page = page
        self.log = log  # the program's logger: a malformed request is logged there
        # The server's own metrics, appended to every /metrics answer (the exporter renders the rest).
        self.own_registry = CollectorRegistry()
        # Rendered once per content type and kept until a count changes (rendering even these three
        # series costs a third of a cached scrape).
        self._closed_version = 0
        self._count_lock = threading.Lock()  # a count and its version change together
        self._own_bodies: dict[str, tuple[int, bytes]] = {}
        super().__init__(address, _Handler, max_connections=max_connections, read_timeout=read_timeout,
                         closed_metric=closed_metric, registry=self.own_registry)

    def metrics_body(self, accept: str) -> tuple[bytes, str]:
        """The program's exposition for this Accept header, with this server's own metrics at its end."""
        body, content_type = self.metrics(accept)
        encoder, own_type = choose_encoder(accept)
        if own_type != content_type:  # not the format the program chose: leave its answer alone
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

    def count_closed(self, reason: str) -> None:
        with self._count_lock:  # from the accept loop and connection threads at once
            super().count_closed(reason)
            self._closed_version += 1

    def handle_error(self, request, client_address) -> None:
        # A client that resets or vanishes mid-answer: not worth socketserver's traceback on stderr.
        self.log.debug("http: connection from %s ended with an error", client_address, exc_info=True)


class _Handler(DeadlineHandler):
    server: MetricsServer

    @property
    def malformed_log(self) -> logging.Logger:  # type: ignore[override]
        return self.server.log

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, content_type = self.server.metrics_body(self.headers.get("Accept", ""))
            self.send_body(200, body, content_type)
        elif path == "/healthz":
            self.send_json(200, self.server.health())
        elif path == "/":
            self.send_body(200, self.server.page, "text/html; charset=utf-8")
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
        if self.server.log.isEnabledFor(logging.DEBUG):  # the client's text: escaped, bounded
            self.server.log.debug("http: %s", quote(format % args, 300))
