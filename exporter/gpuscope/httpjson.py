"""JSON answers for the standard library's HTTP servers (the exporter's and the alert receiver's).

Every error a client gets is ``{"error": "<what is wrong>", "status": <code>, ...}``, also for a
request the HTTP parser itself rejects (bad request line, oversized headers), which
``BaseHTTPRequestHandler`` would otherwise answer in HTML.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def send_body(self, status: int, body: bytes, content_type: str,
                  headers: dict[str, str] | None = None) -> None:
        """The whole answer in one write (two would cost a second system call, and a second segment
        the client waits for); HEAD gets the headers only."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        # What end_headers() does, with the body joined to the buffered headers before the flush.
        self._headers_buffer.append(b"\r\n")
        if self.command != "HEAD":
            self._headers_buffer.append(body)
        self.flush_headers()

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_body(status, json.dumps(obj).encode() + b"\n", "application/json", headers)

    def send_json_error(self, status: int, message: str, headers: dict[str, str] | None = None,
                        **details: Any) -> None:
        self.send_json(status, {"error": message, "status": int(status), **details}, headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Called by the HTTP parser for malformed requests: the body may be unread, so close.
        self.close_connection = True
        self.send_json_error(code, message or explain or HTTPStatus(code).phrase)
