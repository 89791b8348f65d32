"""The HTTP API (aiohttp): OpenAI-style completions and chat completions, metrics, health, fault admin.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status for anything the client got wrong; the middleware turns
aiohttp's own errors (404, 405, 413) into the same shape, and :class:`AppRunner`
does the same for what aiohttp's HTTP parser rejects before any route runs
(oversized request line or headers, malformed HTTP). Client mistakes and clients
that hang up are counted in ``gpuscope_http_client_errors_total{reason}`` and
never logged at ERROR: the Loki error-burst rule counts ERROR lines. Engine
events arrive from the engine thread through ``loop.call_soon_threadsafe``, one
call per step. With request tracing (``tracing.RequestTracing``, passed to
``build_app``) the completions route starts each request's server span, takes the
request's trace id from it and hands the finished request to the tracer; without
it the route is the untraced one and nothing of OpenTelemetry is imported.

Both generation routes run ``_generate``; only the parsing (``protocol.parse_completion``,
``chat.parse_chat``) and the response shapes (``shapes.py``) differ. The TTFT a client sees is
observed here, when the first non-empty text is written (``_sent_text``); the engine observes its own.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from prometheus_client import Counter
from prometheus_client.exposition import choose_encoder

from gpuscope.contract import catalogue as c
from gpuscope.contract.choices import MetricNames
from gpuscope.util.logsafe import quote

from . import pipelining
from .accept import CappedSite
from .chat import ChatTemplate, parse_chat, template_for
from .engine import Done, Failed, Request, Token
from .errors import error_response
from .faults import FaultError, FaultInjector
from .limits import CLOSE_REASONS, BodyTimeout, LimitedRequestHandler, socket_cap
from .limits import SUPPORTED as LIMITS_SUPPORTED
from .loop_lag import LoopMonitor
from .profile.api import add_routes as add_profile_routes
from .protocol import (
    BadRequest,
    Completion,
    new_trace_id,
    parse_completion,
    parse_traceparent,
    resolve_tenant,
    traceparent,
)
from .scheduler import QueueFull
from .service import Service
from .shapes import ChatShape, CompletionShape, sse
from .shutdown import Drain

if TYPE_CHECKING:
    from .http_settings import HttpLimits
    from .tracing import RequestTrace, RequestTracing

log = logging.getLogger("gpuscope.server")
SERVICE = web.AppKey("service", Service)
TRACING = web.AppKey("tracing", object)
DRAIN = web.AppKey("drain", Drain)
CONNECTIONS_CLOSED = web.AppKey("connections_closed", Counter)
LOOP_MONITOR = web.AppKey("loop_monitor", LoopMonitor)
CLIENT_ERRORS = web.AppKey("client_errors", Counter)
CLIENT_ERROR_REASONS = ("malformed", "bad_body", "disconnect")

#: Limits of aiohttp's HTTP parser. The two line limits differ so that a ``LineTooLong`` says, by its
#: limit, which one was exceeded: the request line (414) or a header field (431).
MAX_REQUEST_LINE = 8190  # method, target and version (aiohttp's default)
MAX_HEADER_FIELD = 8192  # one header field, name and value
MAX_HEADERS = 128  # header fields per request (aiohttp's default)
#: How long closing the tracing may take at shutdown (its exporter's last export).
CLOSE_TRACING_S = 5.0


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text.strip().splitlines()[0].rstrip(":")[:limit] if text.strip() else type(exc).__name__


def malformed_request(exc: HttpProcessingError) -> tuple[int, str]:
    """(status, message) for what aiohttp's HTTP parser rejected: 414, 431, else 400."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == MAX_REQUEST_LINE:
            return 414, f"request line is longer than {MAX_REQUEST_LINE} bytes"
        if limit == MAX_HEADER_FIELD:
            return 431, f"a header field is longer than {MAX_HEADER_FIELD} bytes"
    elif _first_line(exc) == "Too many headers received":
        return 431, f"more than {MAX_HEADERS} header fields"
    return 400, f"malformed HTTP request: {_first_line(exc)}"


def client_gone(request: web.BaseRequest) -> bool:
    """Whether the client's connection is closed (or closing): nobody is left to answer."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _count(request: web.Request, reason: str) -> None:
    counter = request.app.get(CLIENT_ERRORS)
    if counter is not None:
        counter.labels(reason).inc()


@web.middleware
async def json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return error_response(exc.status, message, headers=headers)
    except asyncio.CancelledError:
        if client_gone(request):  # cancelled because the client went away (not a shutdown)
            _count(request, "disconnect")
        raise
    except BodyTimeout as exc:  # a body shorter than its Content-Length, or one that trickles (limits.py)
        log.info("%s %s: %s", request.method, quote(request.path, 200), exc)
        response = error_response(408, str(exc))
        response.force_close()
        return response
    except (ConnectionError, RequestPayloadError) as exc:
        # Reading the body or writing the answer failed: a client that hung up (ConnectionResetError,
        # aiohttp's ClientConnectionResetError, a payload cut short) or sent a broken body. Its fault.
        if client_gone(request):
            _count(request, "disconnect")
            log.debug("client went away during %s %s: %s", request.method, quote(request.path, 200),
                      _first_line(exc))
            return error_response(400, "client disconnected")  # nobody reads it; aiohttp drops it
        if isinstance(exc, RequestPayloadError):
            _count(request, "bad_body")
            message = f"request body is malformed: {_first_line(exc.__cause__ or exc)}"
            log.info("%s %s: %s", request.method, quote(request.path, 200), message)
            response = error_response(400, message)
            response.force_close()  # the body's framing is lost: nothing after it can be parsed
            return response
        log.exception("unhandled error in %s %s", request.method, quote(request.path, 200))
        return error_response(500, "internal server error", "server_error")
    except Exception:
        log.exception("unhandled error in %s %s", request.method, quote(request.path, 200))
        return error_response(500, "internal server error", "server_error")


def _dispatch(events: list[tuple[Request, Any]]) -> None:
    for req, event in events:
        if req.channel is not None:
            req.channel.put_nowait(event)


async def _on_startup(app: web.Application) -> None:
    loop = asyncio.get_running_loop()
    monitor = app[LOOP_MONITOR]
    dispatch = monitor.timed(_dispatch)

    def deliver(events):
        if not loop.is_closed():
            loop.call_soon_threadsafe(dispatch, events, time.perf_counter())

    monitor.start()
    app[SERVICE].start(deliver)


async def _on_cleanup(app: web.Application) -> None:
    await app[LOOP_MONITOR].stop()
    await asyncio.get_running_loop().run_in_executor(None, app[SERVICE].close)


async def _close_tracing(app: web.Application) -> None:
    # After _on_cleanup: the engine has finished (aborted) what was in flight, so those spans go too.
    # Closing joins threads and may wait on the exporter: off the event loop.
    await asyncio.get_running_loop().run_in_executor(None, app[TRACING].close, CLOSE_TRACING_S)


#: What a generation route makes of a body: the completion, its response shape, add special tokens.
Parsed = tuple[Completion, CompletionShape, bool]
FaultHandler = Callable[["Handlers", web.Request, FaultInjector], Awaitable[web.Response]]


def _fault_endpoint(handler: FaultHandler) -> Callable[[Handlers, web.Request], Awaitable[web.Response]]:
    """A fault-injection endpoint: the bearer token is checked first (``Handlers._authorize``), then
    ``handler`` gets the injector; a FaultError it raises is answered with its status and message."""

    @functools.wraps(handler)
    async def endpoint(self: Handlers, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        if denied is not None:
            return denied
        assert self.service.faults is not None  # _authorize answers 404 without one
        try:
            return await handler(self, request, self.service.faults)
        except FaultError as exc:
            return error_response(exc.status, str(exc))

    return endpoint


class Handlers:
    def __init__(self, service: Service, tracing: RequestTracing | None = None) -> None:
        self.service = service
        self.config = service.config
        self.tracing = tracing
        self.chat_template: ChatTemplate = template_for(service.runner)

    # --- completions and chat completions ---------------------------------------------
    async def _traced(self, request: web.Request, handler) -> web.StreamResponse:
        """``handler`` inside the request's server span (the routes when tracing is on)."""
        tracing = self.tracing
        assert tracing is not None
        rt = tracing.begin(request.headers, request.match_info.route.resource.canonical)
        response = None
        try:
            response = await handler(request, rt)
            return response
        finally:
            tracing.end(rt, response.status if response is not None else None)

    async def completions_traced(self, request: web.Request) -> web.StreamResponse:
        return await self._traced(request, self.completions)

    async def chat_traced(self, request: web.Request) -> web.StreamResponse:
        return await self._traced(request, self.chat)

    async def completions(self, request: web.Request, rt: RequestTrace | None = None) -> web.StreamResponse:
        def parse(body: Any) -> Parsed:
            completion = parse_completion(body, self.config)
            return completion, CompletionShape(self.config.model_name, completion.include_usage), True

        return await self._generate(request, rt, parse)

    async def chat(self, request: web.Request, rt: RequestTrace | None = None) -> web.StreamResponse:
        def parse(body: Any) -> Parsed:
            completion, special = parse_chat(body, self.config, self.chat_template)
            return completion, ChatShape(self.config.model_name, completion.include_usage), special

        return await self._generate(request, rt, parse)

    async def _generate(self, request: web.Request, rt: RequestTrace | None,
                        parse: Callable[[Any], Parsed]) -> web.StreamResponse:
        arrival = time.perf_counter()  # TTFT and e2e count the body's reading and parsing too
        if rt is None:
            trace_id = parse_traceparent(request.headers.get("traceparent")) or new_trace_id()
            headers = {"traceparent": traceparent(trace_id), "X-Trace-Id": trace_id}
        else:  # the server span's trace id and span id (a valid incoming traceparent is its parent)
            trace_id = rt.trace_id
            headers = {"traceparent": rt.traceparent, "X-Trace-Id": trace_id}
        try:
            tenant = resolve_tenant(self.config, request.headers.get("X-Tenant"))
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                limit = self.config.max_body_bytes
                raise BadRequest(413, f"request body is larger than {limit} bytes") from None
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise BadRequest(400, f"request body is not valid JSON: {str(exc)[:120]}") from None
            completion, shape, special = parse(body)
        except BadRequest as exc:
            return web.json_response(exc.body(), status=exc.status, headers=headers)
        req = Request(tenant, completion.prompt_ids, completion.max_tokens, completion.temperature, trace_id,
                      arrival=arrival, channel=asyncio.Queue(), ignore_eos=completion.ignore_eos,
                      stop=completion.stop, add_special_tokens=special)
        if rt is not None:
            self.tracing.track(rt, req, tenant)
        try:
            self.service.engine.submit(req)
        except QueueFull as exc:
            self.service.metrics.requests.labels(tenant, "rejected").inc()
            retry = str(exc.retry_after)
            return error_response(429, f"queue of tenant {tenant!r} is full; retry after {retry}s",
                                  "rate_limit_error", headers={**headers, "Retry-After": retry})
        try:
            if completion.stream:
                return await self._stream(request, req, shape, headers, rt)
            return await self._collect(req, shape, headers, rt)
        finally:
            if req.outcome is None:
                self.service.engine.cancel(req)

    def _sent_text(self, req: Request) -> None:
        """The request's first non-empty text has gone to the client: its TTFT, as the client sees it."""
        if req.first_text_at is None:
            req.first_text_at = now = time.perf_counter()
            m = self.service.metrics
            m.observe(m.ttft, req.tenant, now - req.arrival, req.trace_id)

    async def _collect(self, req: Request, shape: CompletionShape, headers: dict,
                       rt: RequestTrace | None = None) -> web.Response:
        parts: list[str] = []
        while True:
            event = await req.channel.get()
            if isinstance(event, Token):
                # Not streamed: the text is ready when a stream would have sent it.
                self._sent_text(req)
                parts.append(event.text)
            elif isinstance(event, Done):
                if event.text_tail:
                    self._sent_text(req)
                parts.append(event.text_tail)
                return web.json_response(shape.body("".join(parts), event), headers=headers)
            elif isinstance(event, Failed):
                status = 503 if event.reason == "abort" else 500
                if rt is not None:
                    rt.error = event.message
                return error_response(status, event.message, "server_error", headers=headers)

    async def _stream(self, request: web.Request, req: Request, shape: CompletionShape, headers: dict,
                      rt: RequestTrace | None = None) -> web.StreamResponse:
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        write = response.write
        if rt is not None:
            rt.stream_start = time.perf_counter()
            write = rt.timed(response.write)
        try:
            for chunk in shape.opening():
                await write(sse(chunk))
            while True:
                event = await req.channel.get()
                if isinstance(event, Token) and shape.merges_last and not req.channel.empty():
                    after = req.channel.get_nowait()  # the same step's events arrive together
                    if isinstance(after, Done):  # the last token's text goes in the finish chunk, as vLLM's
                        event = replace(after, text_tail=event.text + after.text_tail)
                    else:
                        await write(sse(shape.text(event.text)))
                        self._sent_text(req)
                        event = after
                if isinstance(event, Token):
                    await write(sse(shape.text(event.text)))
                    self._sent_text(req)
                    continue
                if isinstance(event, Done):
                    for chunk in shape.closing(event):
                        await write(sse(chunk))
                    if event.text_tail:
                        self._sent_text(req)
                elif isinstance(event, Failed):
                    if rt is not None:
                        rt.error = event.message
                    error = {"error": {"message": event.message, "type": "server_error", "code": 500}}
                    await write(sse(error))
                await write(b"data: [DONE]\n\n")
                await response.write_eof()
                if rt is not None:
                    rt.stream_end = time.perf_counter()
                return response
        except ConnectionResetError:
            # The client went away mid-stream: the engine drops the request at its next step.
            self.service.engine.cancel(req)
            _count(request, "disconnect")
            if rt is not None:
                rt.stream_end, rt.disconnected = time.perf_counter(), True
            return response

    # --- metadata, health, metrics -----------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "gpuscope",
                 "max_model_len": self.config.model.context}
        return web.json_response({"object": "list", "data": [model]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        """vLLM's ``/health``: 200 with an empty body while the engine runs, else 503 (JSON)."""
        engine = self.service.engine
        if engine.ready.is_set() and engine.alive():
            return web.Response(status=200)
        return error_response(503, "engine is not ready", "server_error")

    async def readyz(self, request: web.Request) -> web.Response:
        engine = self.service.engine
        if engine.ready.is_set() and engine.alive():
            return web.json_response({"status": "ready"})
        return error_response(503, "engine is not ready", "server_error")

    async def metrics(self, request: web.Request) -> web.Response:
        # OpenMetrics when the scraper asks for it (Prometheus with exemplar storage does): exemplars show.
        # Under vLLM's names, the text format: vLLM attaches no exemplars, and prometheus_client's
        # OpenMetrics writer (0.26) turns the colons of sample names into underscores.
        accept = "" if self.config.metric_names == MetricNames.VLLM else request.headers.get("Accept", "")
        encoder, content_type = choose_encoder(accept)
        return web.Response(body=encoder(self.service.registry), headers={"Content-Type": content_type})

    # --- fault injection ---------------------------------------------------------
    def _authorize(self, request: web.Request) -> web.Response | None:
        if self.service.faults is None:
            return error_response(404, "fault injection is disabled (start with --faults.enable)",
                                  "not_found")
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return error_response(401, "missing 'Authorization: Bearer <token>'", "authentication_error",
                                  headers={"WWW-Authenticate": "Bearer"})
        token = self.config.faults_token or ""
        if not hmac.compare_digest(auth[len("Bearer "):].strip().encode(), token.encode()):
            return error_response(403, "wrong fault-injection token", "permission_error")
        return None

    @_fault_endpoint
    async def faults_list(self, request: web.Request, faults: FaultInjector) -> web.Response:
        return web.json_response({"active": faults.describe()})

    @_fault_endpoint
    async def fault_set(self, request: web.Request, faults: FaultInjector) -> web.Response:
        try:
            raw = await request.read()
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):
            return error_response(400, "request body is not valid JSON")
        return web.json_response(faults.activate(request.match_info["name"], body))

    @_fault_endpoint
    async def fault_clear(self, request: web.Request, faults: FaultInjector) -> web.Response:
        name = request.match_info["name"]
        return web.json_response({"name": name, "cleared": faults.clear(name)})


def build_app(service: Service, tracing: RequestTracing | None = None) -> web.Application:
    """The aiohttp application; the engine starts with the app and stops at its cleanup.

    Serve it with :class:`AppRunner` (or :func:`run`): a plain ``web.AppRunner`` answers what the
    HTTP parser rejects in aiohttp's text/plain and logs it at ERROR. With ``tracing`` every
    completion gets a trace (it observes the engine's steps from now on, and closes after the engine).
    """
    limits = {"max_line_size": MAX_REQUEST_LINE, "max_field_size": MAX_HEADER_FIELD,
              "max_headers": MAX_HEADERS}
    drain = Drain(service, service.registry, service.config.http.shutdown_grace_s, error_response)
    app = web.Application(client_max_size=service.config.max_body_bytes,
                          middlewares=[json_errors, drain.middleware], handler_args=limits)
    app[SERVICE] = service
    app[DRAIN] = drain
    connections_closed = c.HTTP_CONNECTIONS_CLOSED.create(service.registry)
    for reason in CLOSE_REASONS:
        connections_closed.labels(reason)
    app[CONNECTIONS_CLOSED] = connections_closed
    client_errors = c.HTTP_CLIENT_ERRORS.create(service.registry)
    for reason in CLIENT_ERROR_REASONS:
        client_errors.labels(reason)
    app[CLIENT_ERRORS] = client_errors
    app[LOOP_MONITOR] = LoopMonitor(service.registry)
    h = Handlers(service, tracing)
    app.router.add_post("/v1/completions", h.completions if tracing is None else h.completions_traced)
    app.router.add_post("/v1/chat/completions", h.chat if tracing is None else h.chat_traced)
    app.router.add_get("/health", h.health)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/healthz", h.healthz)
    app.router.add_get("/readyz", h.readyz)
    app.router.add_get("/admin/faults", h.faults_list)
    app.router.add_post("/admin/faults/{name}", h.fault_set)
    app.router.add_delete("/admin/faults/{name}", h.fault_clear)
    add_profile_routes(app, service.profile)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    if tracing is not None:
        tracing.attach(service)
        app[TRACING] = tracing
        app.on_cleanup.append(_close_tracing)
    return app


# --- serving: aiohttp's runner, with JSON answers to what its HTTP parser rejects -----------------


class _JsonErrorRequestHandler(LimitedRequestHandler):
    """aiohttp's per-connection protocol; errors raised before any route runs get the API's JSON shape.

    aiohttp answers a request its parser rejects (``HttpProcessingError``: request line or a header
    over the limits, too many headers, bad syntax) through ``handle_error``, in text/plain, after
    logging it at ERROR with a traceback. Those are the client's mistakes: here they are a 4xx JSON
    error, one INFO line and a count. Server-side failures (500, 504) keep aiohttp's ERROR log.
    """

    client_errors: Counter | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if pipelining.SUPPORTED:  # requests pipelined before a malformed one are answered first
            self._parser = pipelining.OrderedParser(self._parser, getattr(self, "_max_msg_queue_size", 0))

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp does: the answer has begun, the connection is broken
            raise ConnectionError("Response is sent already, cannot send another response "
                                  "with the error message")
        if isinstance(exc, HttpProcessingError) and status < 500:
            status, text = malformed_request(exc)
            if self.client_errors is not None:
                self.client_errors.labels("malformed").inc()
            log.info("malformed HTTP request from %s, answered %d: %s", request.remote, status, text)
            response = error_response(status, text)
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            phrase = HTTPStatus(status).phrase.lower() if status in HTTPStatus._value2member_map_ else "error"
            response = error_response(status, phrase, "server_error")
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # After answering, aiohttp reads what is left of an unread body ("lingering"); a body that
        # turns out broken (bad Content-Encoding, say) raises there and aiohttp logs it at ERROR.
        # The client's fault, already answered: debug only.
        if isinstance(kw.get("exc_info"), (RequestPayloadError, ConnectionError)):
            log.debug("after the answer: %s", _first_line(kw["exc_info"]))
            return
        super().log_exception(*args, **kw)


class _JsonErrorServer(web.Server):
    """aiohttp's low-level server, making :class:`_JsonErrorRequestHandler` connections."""

    client_errors: Counter | None = None
    limits: HttpLimits | None = None
    connections_closed: Counter | None = None

    def __call__(self) -> RequestHandler:
        handler = _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.client_errors = self.client_errors
        if self.limits is not None:
            handler.limits = self.limits
        handler.connections_closed = self.connections_closed
        return handler


class AppRunner(web.AppRunner):
    """``web.AppRunner`` for :func:`build_app`'s app, whose connections answer parser errors in JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The server aiohttp built for this app; only the connection protocol it makes differs.
        server.__class__ = _JsonErrorServer
        server.client_errors = self.app.get(CLIENT_ERRORS)
        server.limits = self.app[SERVICE].config.http
        if not LIMITS_SUPPORTED:
            log.warning("this aiohttp lacks the connection state the read deadlines and connection cap "
                        "use: serving without them")
        server.connections_closed = self.app.get(CONNECTIONS_CLOSED)
        return server


def run(app: web.Application, host: str, port: int, shutdown_timeout: float = 1.0) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully (shutdown.py): drain within the
    app's grace (``--shutdown.grace``), end what is left with an error chunk and ``[DONE]``, then close
    the connections (idle ones at once, others after ``shutdown_timeout``) and stop the engine.

    Raises OSError when the address cannot be bound (the app's cleanup has run by then).
    """

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        drain = app[DRAIN]

        def on_signal() -> None:
            if stop.is_set():
                drain.hurry()  # a second signal: end the grace now
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        runner = AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
        await runner.setup()
        try:
            # Accepts only while fewer than the cap's sockets are open (accept.py): asyncio's own accept
            # loop takes a whole burst at once, whatever the cap then closes.
            await CappedSite(runner, host, port, limit=socket_cap(app[SERVICE].config.http)).start()
            await stop.wait()
            await drain.run()
            _close_idle(runner)
        finally:
            await runner.cleanup()  # every handler is done by now; then the engine and timer stop

    asyncio.run(serve())


def _close_idle(runner: web.AppRunner) -> None:
    """Close kept-alive connections waiting for a next request (aiohttp's shutdown would wait
    ``shutdown_timeout`` for each before closing it)."""
    server = runner.server
    for handler in server.connections if server is not None else ():
        if isinstance(handler, LimitedRequestHandler) and handler._idle():
            handler.force_close()
