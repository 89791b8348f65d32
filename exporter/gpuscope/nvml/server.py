"""HTTP endpoints: ``/metrics`` (Prometheus text, or OpenMetrics when asked), ``/`` and ``/healthz``.

A threaded server, so a slow client never holds up Prometheus. ``/metrics`` serves bytes the
exporter rendered in the background (``rendered.py``), so a scrape costs the same at 1 or 64
GPUs. Anything else answers 404 or 405 with a JSON body saying what exists.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("gpuscope.exporter")

_PAGE = b"""<!doctype html><html><head><title>gpuscope exporter</title></head><body>
<h1>gpuscope exporter</h1><p>NVML GPU metrics, sampled in the background.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li></ul>
</body></html>
"""
ENDPOINTS = ("/", "/metrics", "/healthz")


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], metrics: Callable[[str], tuple[bytes, str]],
                 health: Callable[[], dict]) -> None:
        self.metrics = metrics  # Accept header → (body, content type)
        self.health = health
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="gpuscope-http", daemon=True)
        thread.start()
        return thread


class _Handler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, the second waits for a delayed ACK
    # (up to 40 ms on Linux) on keep-alive connections, which is what Prometheus uses.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, content_type = self.server.metrics(self.headers.get("Accept", ""))
            self._send(200, body, content_type)
        elif path == "/healthz":
            self._json(200, self.server.health())
        elif path == "/":
            self._send(200, _PAGE, "text/html; charset=utf-8")
        else:
            self._json(404, {"error": f"no such path: {path}", "endpoints": list(ENDPOINTS)})

    def do_HEAD(self) -> None:
        self.do_GET()

    def _method_not_allowed(self) -> None:
        self.close_connection = True  # the request body is not read
        self._json(405, {"error": f"method {self.command} not allowed", "allowed": ["GET", "HEAD"]})

    do_POST = do_PUT = do_DELETE = do_PATCH = _method_not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Malformed requests (bad request line, oversized headers): JSON like every other error.
        self.close_connection = True
        self._json(code, {"error": message or explain or "bad request"})

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode() + b"\n", "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status == 405:
            self.send_header("Allow", "GET, HEAD")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: " + format, *args)
