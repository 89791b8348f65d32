"""The HTTP API (aiohttp): OpenAI-style completions, metrics, health, and the fault admin routes.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status for anything the client got wrong; the middleware turns
aiohttp's own errors (404, 405, 413) into the same shape. Engine events arrive
from the engine thread through ``loop.call_soon_threadsafe``, one call per step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from .engine import Done, Failed, Request, Token
from .faults import FaultError
from .protocol import (
    BadRequest,
    new_trace_id,
    parse_completion,
    parse_traceparent,
    resolve_tenant,
    traceparent,
)
from .scheduler import QueueFull
from .service import Service

log = logging.getLogger("gpuscope.server")
SERVICE = web.AppKey("service", Service)


def error_response(status: int, message: str, code: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": code, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


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
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal server error", "server_error")


def _usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _dispatch(events: list[tuple[Request, Any]]) -> None:
    for req, event in events:
        if req.channel is not None:
            req.channel.put_nowait(event)


async def _on_startup(app: web.Application) -> None:
    loop = asyncio.get_running_loop()

    def deliver(events):
        if not loop.is_closed():
            loop.call_soon_threadsafe(_dispatch, events)

    app[SERVICE].start(deliver)


async def _on_cleanup(app: web.Application) -> None:
    await asyncio.get_running_loop().run_in_executor(None, app[SERVICE].close)


class Handlers:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.config = service.config

    # --- completions -------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        trace_id = parse_traceparent(request.headers.get("traceparent")) or new_trace_id()
        headers = {"traceparent": traceparent(trace_id), "X-Trace-Id": trace_id}
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
            completion = parse_completion(body, self.config)
        except BadRequest as exc:
            return web.json_response(exc.body(), status=exc.status, headers=headers)
        req = Request(tenant, completion.prompt_ids, completion.max_tokens, completion.temperature, trace_id,
                      channel=asyncio.Queue())
        try:
            self.service.engine.submit(req)
        except QueueFull as exc:
            self.service.metrics.requests.labels(tenant, "rejected").inc()
            retry = str(exc.retry_after)
            return error_response(429, f"queue of tenant {tenant!r} is full; retry after {retry}s",
                                  "rate_limit_error", headers={**headers, "Retry-After": retry})
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.config.model_name}
        try:
            if completion.stream:
                return await self._stream(request, req, meta, headers)
            return await self._collect(req, meta, headers)
        finally:
            if req.outcome is None:
                self.service.engine.cancel(req)

    async def _collect(self, req: Request, meta: dict, headers: dict) -> web.Response:
        parts: list[str] = []
        while True:
            event = await req.channel.get()
            if isinstance(event, Token):
                parts.append(event.text)
            elif isinstance(event, Done):
                parts.append(event.text_tail)
                choice = {"index": 0, "text": "".join(parts), "finish_reason": event.reason, "logprobs": None}
                body = {**meta, "choices": [choice], "usage": _usage(event)}
                return web.json_response(body, headers=headers)
            elif isinstance(event, Failed):
                status = 503 if event.reason == "abort" else 500
                return error_response(status, event.message, "server_error", headers=headers)

    async def _stream(self, request: web.Request, req: Request, meta: dict,
                      headers: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)

        def chunk(text: str, finish: str | None = None, **extra) -> bytes:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            body = {**meta, "choices": [choice], **extra}
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        try:
            while True:
                event = await req.channel.get()
                if isinstance(event, Token):
                    await response.write(chunk(event.text))
                    continue
                if isinstance(event, Done):
                    await response.write(chunk(event.text_tail, event.reason, usage=_usage(event)))
                elif isinstance(event, Failed):
                    error = {"error": {"message": event.message, "type": "server_error", "code": 500}}
                    await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
        except ConnectionResetError:
            # The client went away mid-stream: the engine drops the request at its next step.
            self.service.engine.cancel(req)
            return response

    # --- metadata, health, metrics -----------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "gpuscope",
                 "max_model_len": self.config.model.context}
        return web.json_response({"object": "list", "data": [model]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        engine = self.service.engine
        if engine.ready.is_set() and engine.alive():
            return web.json_response({"status": "ready"})
        return error_response(503, "engine is not ready", "server_error")

    async def metrics(self, request: web.Request) -> web.Response:
        # OpenMetrics when the scraper asks for it (Prometheus with exemplar storage does): exemplars show.
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
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

    async def faults_list(self, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        if denied is not None:
            return denied
        assert self.service.faults is not None
        return web.json_response({"active": self.service.faults.describe()})

    async def fault_set(self, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        if denied is not None:
            return denied
        assert self.service.faults is not None
        try:
            raw = await request.read()
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):
            return error_response(400, "request body is not valid JSON")
        try:
            state = self.service.faults.activate(request.match_info["name"], body)
        except FaultError as exc:
            return error_response(exc.status, str(exc))
        return web.json_response(state)

    async def fault_clear(self, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        if denied is not None:
            return denied
        assert self.service.faults is not None
        try:
            removed = self.service.faults.clear(request.match_info["name"])
        except FaultError as exc:
            return error_response(exc.status, str(exc))
        return web.json_response({"name": request.match_info["name"], "cleared": removed})


def build_app(service: Service) -> web.Application:
    """The aiohttp application; the engine starts with the app and stops at its cleanup."""
    app = web.Application(client_max_size=service.config.max_body_bytes, middlewares=[json_errors])
    app[SERVICE] = service
    h = Handlers(service)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/healthz", h.healthz)
    app.router.add_get("/readyz", h.readyz)
    app.router.add_get("/admin/faults", h.faults_list)
    app.router.add_post("/admin/faults/{name}", h.fault_set)
    app.router.add_delete("/admin/faults/{name}", h.fault_clear)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app
