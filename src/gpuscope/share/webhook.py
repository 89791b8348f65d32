"""gpuscope share-webhook: a mutating admission webhook that joins annotated pods to `gpuscope share`.

    gpuscope share-webhook --web.tls-cert /tls/tls.crt --web.tls-key /tls/tls.key

The API server sends it every pod created in a namespace labelled ``gpuscope.io/share: enabled``
(the MutatingWebhookConfiguration's namespaceSelector). A pod annotated
``gpuscope.io/share-tenant: NAME`` is answered with the patch of ``injection.py``; any other is
allowed unchanged. It fails open, as its configuration does (``failurePolicy: Ignore``): a review it
cannot read is allowed, with a warning, and counted (``gpuscope_share_webhook_reviews_total``).

HTTPS only (the API server calls webhooks over TLS): POST /mutate, GET /healthz, GET /metrics, with
the same connection limits as the other servers (``util/bounded_http.py``); the TLS handshake runs in
the connection's own thread, within its read deadline.
"""

from __future__ import annotations

import json
import logging
import signal
import ssl
import sys
import threading
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpuscope.contract import catalogue as cat
from gpuscope.share import deploy
from gpuscope.share.injection import review_response
from gpuscope.util.bounded_http import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    BadRequest,
    BoundedHTTPServer,
    DeadlineHandler,
    parse_max_connections,
)
from gpuscope.util.flags import listen_address, parse_duration, parse_listen_address
from gpuscope.util.settings import SettingsParser, parser_for, setting

log = logging.getLogger("gpuscope.share.webhook")
#: An AdmissionReview of a pod is a few kB; the API server's own limit on objects is 3 MiB.
MAX_BODY_BYTES = 4 << 20
RESULTS = ("mutated", "passed", "error")


@dataclass(frozen=True)
class WebhookSettings:
    """The flags of ``gpuscope share-webhook``."""

    listen: str = setting("--web.listen-address", f"0.0.0.0:{deploy.WEBHOOK_PORT}", "HOST:PORT to serve on",
                          parse=listen_address, metavar="HOST:PORT")
    tls_cert: str = setting("--web.tls-cert", "", "the server's certificate (PEM; the API server must trust "
                            "its CA: the caBundle of the MutatingWebhookConfiguration)")
    tls_key: str = setting("--web.tls-key", "", "the certificate's private key (PEM)")
    max_connections: int = setting("--web.max-connections", DEFAULT_MAX_CONNECTIONS,
                                   "most HTTPS connections at once", parse=parse_max_connections)
    read_timeout: float = setting("--web.read-timeout", DEFAULT_READ_TIMEOUT, "each request (the TLS "
                                  "handshake included) must arrive whole within this", parse=parse_duration)


class WebhookServer(BoundedHTTPServer):
    """The bounded server over TLS, with the reviews' counters."""

    def __init__(self, address: tuple[str, int], context: ssl.SSLContext, *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
        self.registry = CollectorRegistry()
        self.reviews = cat.SHARE_WEBHOOK_REVIEWS.create(self.registry)
        for result in RESULTS:
            self.reviews.labels(result)
        super().__init__(address, _Handler, max_connections=max_connections, read_timeout=read_timeout,
                         closed_metric=cat.SHARE_WEBHOOK_HTTP_CONNECTIONS_CLOSED, registry=self.registry)
        # no handshake in accept(): a client that stalls it would hold up every other connection
        self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    @property
    def url(self) -> str:
        return "https" + super().url[len("http"):]


class _Handler(DeadlineHandler):
    server: WebhookServer
    malformed_log = log

    def setup(self) -> None:
        self.request.settimeout(self.server.read_timeout)
        try:
            self.request.do_handshake()
        except (OSError, ssl.SSLError):  # a plain-HTTP client, a bad certificate, or a stall
            self.server.count_closed("timeout")
            raise
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the API server calls for every pod: counted, not logged

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self.send_json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/metrics":
            self.send_body(HTTPStatus.OK, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        else:
            self.send_json_error(HTTPStatus.NOT_FOUND, f"no such path {path!r} (POST {deploy.WEBHOOK_PATH}, "
                                 "GET /healthz, GET /metrics)")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != deploy.WEBHOOK_PATH:
            self.send_json_error(HTTPStatus.NOT_FOUND,
                                 f"POST {path!r} is not served (POST {deploy.WEBHOOK_PATH})")
            return
        try:
            body = self.read_body(MAX_BODY_BYTES)
        except BadRequest as exc:
            self.server.reviews.labels("error").inc()
            self.send_json_error(exc.status, str(exc))
            return
        try:
            review = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            review = None  # answered like any other review it cannot read: allowed, with a warning
        answer, outcome = review_response(review)
        self.server.reviews.labels(outcome.result).inc()
        self.send_json(HTTPStatus.OK, answer)

    def _method_not_allowed(self) -> None:
        self.close_connection = True
        self.send_json_error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not supported")

    do_PUT = do_DELETE = do_PATCH = _method_not_allowed


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def _parser() -> SettingsParser[WebhookSettings]:
    return parser_for(WebhookSettings, prog="gpuscope share-webhook", description=__doc__.splitlines()[0])


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_settings(argv)
    if not args.tls_cert or not args.tls_key:
        parser.error("--web.tls-cert and --web.tls-key are required: the API server calls webhooks over "
                     "HTTPS")
    try:
        context = tls_context(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        parser.error(f"cannot load the certificate {args.tls_cert} and key {args.tls_key}: {exc}")
    host, port = parse_listen_address(args.listen)
    try:
        server = WebhookServer((host, port), context, max_connections=args.max_connections,
                               read_timeout=args.read_timeout)
    except OSError as exc:
        parser.error(f"cannot listen on {args.listen}: {exc.strerror or exc}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.serve_in_thread()
    sys.stderr.write(f"gpuscope share-webhook: {server.url}{deploy.WEBHOOK_PATH}\n")
    stop.wait()
    server.shutdown()
    server.server_close()
    return 0
