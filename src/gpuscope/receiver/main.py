"""``gpuscope receiver``: an Alertmanager webhook receiver that logs and lists notifications.

Alertmanager POSTs each notification (its webhook payload, version 4) to
``/alerts``. The receiver writes it to stdout as one JSON line, keeps the most
recent ones in a bounded list that ``GET /alerts`` returns, and counts them on
``/metrics`` by status. Bad input gets a 4xx with a JSON body naming the
problem; nothing a client sends can crash it.

It uses only the standard library so that it runs wherever the package is
installed, without the server's extras.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, TextIO
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpuscope.contract import catalogue, parts
from gpuscope.contract.parts import default_listen_address
from gpuscope.receiver.profile_trigger import ProfileTrigger, TriggerConfigError, load_config
from gpuscope.util.bounded_http import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    BadRequest,
    BoundedHTTPServer,
    DeadlineHandler,
    max_connections_setting,
    read_timeout_setting,
)
from gpuscope.util.flags import listen_address, parse_listen_address
from gpuscope.util.logsafe import EscapingFilter
from gpuscope.util.settings import SettingsParser, parser_for, setting

STATUSES = ("firing", "resolved")
#: Seconds a connection may take to deliver each whole request, body included (Alertmanager sends
#: whole requests at once; its keep-alive connections idle between notifications).
READ_TIMEOUT_S = DEFAULT_READ_TIMEOUT
logger = logging.getLogger("gpuscope.receiver")


def validate_notification(payload: Any) -> dict[str, Any]:
    """Check the parts of Alertmanager's webhook payload this receiver relies on; raise BadRequest."""
    if not isinstance(payload, dict):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "body must be a JSON object (Alertmanager webhook payload)")
    status = payload.get("status")
    if status not in STATUSES:
        raise BadRequest(HTTPStatus.UNPROCESSABLE_ENTITY,
                         f"status must be one of {list(STATUSES)}, got {status!r}")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise BadRequest(HTTPStatus.UNPROCESSABLE_ENTITY, "alerts must be a list")
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict) or not isinstance(alert.get("labels"), dict):
            raise BadRequest(HTTPStatus.UNPROCESSABLE_ENTITY,
                             f"alerts[{i}] must be an object with a labels object")
    return payload


class NotificationLog:
    """The bounded list of recent notifications, and their counter. Thread-safe."""

    def __init__(self, capacity: int = 500, registry: CollectorRegistry | None = None,
                 out: TextIO | None = None, clock: Callable[[], float] = time.time,
                 on_notification: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._counter = catalogue.RECEIVER_NOTIFICATIONS.create(self.registry)
        for status in STATUSES:
            self._counter.labels(status=status)  # expose zeros, so rate() works from the first alert
        self._recent: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._out = out if out is not None else sys.stdout
        self._clock = clock
        #: e.g. ``profile_trigger.ProfileTrigger.on_notification``; its answer is recorded as ``profiles``
        self._on_notification = on_notification

    def add(self, payload: Any) -> dict[str, Any]:
        """Validate, log as one JSON line, remember and count one notification; return the stored record."""
        notification = validate_notification(payload)
        record = {"received_at": self._clock(), "notification": notification}
        if self._on_notification is not None:
            record["profiles"] = self._on_notification(notification)
        line = json.dumps({"event": "alertmanager_notification", **record}, separators=(",", ":"))
        with self._lock:
            self._recent.append(record)
            self._counter.labels(status=notification["status"]).inc()
            self._out.write(line + "\n")
            self._out.flush()
        return record

    def recent(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Newest last; at most ``limit`` of them."""
        with self._lock:
            items = list(self._recent)
        return items[-limit:] if limit else items


def _make_handler(log: NotificationLog, max_body_bytes: int) -> type[BaseHTTPRequestHandler]:
    # A client that sends nothing, stops mid-request or sends a body shorter than its Content-Length
    # is closed once the server's read timeout has passed (DeadlineHandler), not after each read.
    class Handler(DeadlineHandler):
        server_version = parts.RECEIVER.service
        malformed_log = logger

        def log_message(self, format: str, *args: Any) -> None:
            pass  # stdout carries notifications only, one JSON line each

        def _error(self, status: HTTPStatus, message: str) -> None:
            self.send_json_error(status, message)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            try:
                if url.path == "/alerts":
                    self.send_json(HTTPStatus.OK, {"notifications": log.recent(_limit(url.query))})
                elif url.path == "/metrics":
                    self.send_body(HTTPStatus.OK, generate_latest(log.registry), CONTENT_TYPE_LATEST)
                elif url.path in ("/healthz", "/readyz"):
                    self.send_json(HTTPStatus.OK, {"status": "ok"})
                else:
                    self._error(HTTPStatus.NOT_FOUND, f"no such path {url.path!r} (try /alerts, /metrics)")
            except BadRequest as exc:
                self._error(exc.status, str(exc))

        do_HEAD = do_GET

        def do_POST(self) -> None:
            path = urlsplit(self.path).path
            if path != "/alerts":
                self._error(HTTPStatus.NOT_FOUND if path not in ("/metrics", "/healthz") else
                            HTTPStatus.METHOD_NOT_ALLOWED, f"POST {path!r} is not supported (POST /alerts)")
                return
            try:
                body = self.read_body(max_body_bytes)
                try:
                    payload = json.loads(body)
                except (UnicodeDecodeError, ValueError) as exc:
                    raise BadRequest(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None
                log.add(payload)
            except BadRequest as exc:
                self._error(exc.status, str(exc))
                return
            self.send_json(HTTPStatus.OK, {"status": "ok"})

        def _method_not_allowed(self) -> None:
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not supported")

        do_PUT = do_DELETE = do_PATCH = _method_not_allowed

    return Handler


def _limit(query: str) -> int | None:
    values = parse_qs(query).get("limit")
    if not values:
        return None
    try:
        limit = int(values[0])
    except ValueError:
        limit = -1
    if limit < 1:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"limit must be a positive integer, got {values[0]!r}")
    return limit


class ReceiverServer(BoundedHTTPServer):
    """The exporter's connection limits (util/bounded_http.py); closed connections counted on /metrics."""

    def handle_error(self, request, client_address) -> None:
        # A client that resets, times out or vanishes mid-answer: one line, not a traceback on stderr.
        logger.debug("connection from %s ended with an error", client_address, exc_info=True)


def make_server(host: str, port: int, log: NotificationLog, max_body_bytes: int = 1 << 20,
                read_timeout: float = READ_TIMEOUT_S,
                max_connections: int = DEFAULT_MAX_CONNECTIONS) -> ReceiverServer:
    """A bound (not yet serving) HTTP server; port 0 picks a free one (``server.server_address``)."""
    return ReceiverServer((host, port), _make_handler(log, max_body_bytes), max_connections=max_connections,
                          read_timeout=read_timeout, closed_metric=catalogue.RECEIVER_HTTP_CONNECTIONS_CLOSED,
                          registry=log.registry)


@dataclass(frozen=True)
class ReceiverSettings:
    """The flags of ``gpuscope receiver``."""

    listen: str = setting("--web.listen-address", default_listen_address("receiver"),
                          "HOST:PORT to listen on", parse=listen_address, metavar="HOST:PORT")
    history: int = setting("--receiver.history", 500,
                           "notifications kept for GET /alerts (oldest dropped first)")
    max_body: int = setting("--receiver.max-body-bytes", 1 << 20, "largest notification accepted (413 above)")
    max_connections: int = max_connections_setting()
    read_timeout: float = read_timeout_setting(READ_TIMEOUT_S, body_included=True)
    profile_servers: str | None = setting(
        "--receiver.profile-servers", None, "JSON allow-list of servers (instance label → URL) asked for a "
        "kernel profile on firing latency alerts (off when unset; docs/server.md)")
    profile_token_file: str | None = setting(
        "--receiver.profile-token-file", None,
        "file holding the servers' profile token (else GPUSCOPE_PROFILE_TOKEN)")


def _parser() -> SettingsParser[ReceiverSettings]:
    return parser_for(ReceiverSettings, prog="gpuscope receiver", description=__doc__.splitlines()[0])


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_settings(argv)
    host, port = parse_listen_address(args.listen)
    if args.history < 1:
        parser.error(f"--receiver.history must be at least 1, got {args.history}")
    if args.max_body < 1:
        parser.error(f"--receiver.max-body-bytes must be at least 1, got {args.max_body}")
    registry = CollectorRegistry()
    trigger = None
    if args.profile_servers:
        try:
            trigger = ProfileTrigger(load_config(args.profile_servers, args.profile_token_file, os.environ),
                                     registry)
        except TriggerConfigError as exc:
            parser.error(f"--receiver.profile-servers: {exc}")
    log = NotificationLog(args.history, registry,
                          on_notification=trigger.on_notification if trigger is not None else None)
    try:
        server = make_server(host, port, log, args.max_body, args.read_timeout, args.max_connections)
    except OSError as exc:
        parser.error(f"cannot listen on {args.listen}: {exc.strerror or exc}")
    # Diagnostics (malformed requests) go to stderr as lines with time and level; stdout carries
    # notifications only.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s level=%(levelname)s msg=%(message)s"))
    handler.addFilter(EscapingFilter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    sys.stderr.write(f"gpuscope receiver: listening on http://{args.listen}/alerts\n")
    # As PID 1 in a container, SIGTERM is ignored unless handled: turn it into a clean stop.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
