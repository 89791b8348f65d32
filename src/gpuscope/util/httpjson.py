"""JSON answers for the standard library's HTTP servers (the exporter's and the alert receiver's).

Every error a client gets is ``{"error": "<what is wrong>", "status": <code>, ...}``, also for a
request the HTTP parser itself rejects (bad request line or version, HTTP/0.9, oversized headers),
which ``BaseHTTPRequestHandler`` would otherwise answer in HTML, or for HTTP/0.9 and garbage not at
all (it writes no status line or headers to a request it takes for HTTP/0.9). Each such request
is one INFO line on ``malformed_log``, with the client's text escaped and bounded (logsafe).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from gpuscope.util.logsafe import quote

#: The version our answers to a malformed request carry: whatever the client sent, it gets a status
#: line and headers (an HTTP/0.9 answer would be the bare body).
_ANSWER_VERSION = "HTTP/1.0"


class JsonRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    #: Where a malformed request is logged (one INFO line each); subclasses name their component's.
    malformed_log = logging.getLogger("gpuscope.http")

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

    def parse_request(self) -> bool:
        # "GET /path" alone is HTTP/0.9, which the standard library would serve after waiting for
        # headers that never come (an HTTP/0.9 client sends none): refuse it from the request line.
        words = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n").split()
        if len(words) == 2:
            self.command, self.request_version = None, _ANSWER_VERSION
            self.requestline = " ".join(words)
            self.send_error(HTTPStatus.BAD_REQUEST, "HTTP/0.9 requests are not supported (send HTTP/1.1)")
            return False
        return super().parse_request()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Called by the HTTP parser for malformed requests: the body may be unread, so close.
        self.close_connection = True
        if self.request_version not in ("HTTP/1.0", "HTTP/1.1"):
            self.request_version = _ANSWER_VERSION  # else no status line or headers are written
        text = message or explain or HTTPStatus(code).phrase
        # Only the standard library's parser and dispatcher call send_error (our routes answer through
        # send_json_error): every call is a request it could not take.
        self.malformed_log.info("malformed HTTP request from %s, answered %d: %s; request line %s",
                                self.client_address[0] if self.client_address else "?", int(code),
                                quote(text, 120), quote(getattr(self, "requestline", ""), 120))
        self.send_json_error(code, text)
