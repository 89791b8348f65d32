"""The profile capture routes, protected like the fault-injection ones.

``POST /admin/profile`` asks for a capture of the next steps (202 with its id and where its trace
will be), ``GET /admin/profile`` lists captures, ``GET /admin/profile/{id}`` shows one and
``GET /admin/profile/{id}/trace`` returns its Chrome trace JSON. Every route answers 404 unless the
server runs with ``--profile.enable``, and needs ``Authorization: Bearer <token>`` (401 without, 403
with a wrong one). Errors are the API's JSON error body; 429 and 409 carry ``Retry-After``.
"""

from __future__ import annotations

import hmac
import json
import os

from aiohttp import web

from ..errors import error_response
from .capture import ProfileCapture, ProfileError

PROFILE = web.AppKey("profile", ProfileCapture)


def _authorize(request: web.Request) -> web.Response | None:
    capture = request.app.get(PROFILE)
    if capture is None:
        return error_response(404, "profile captures are disabled (start with --profile.enable)", "not_found")
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer "):
        return error_response(401, "missing 'Authorization: Bearer <token>'", "authentication_error",
                              headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(auth[len("Bearer "):].strip().encode(), capture.config.token.encode()):
        return error_response(403, "wrong profile token", "permission_error")
    return None


def _error(exc: ProfileError) -> web.Response:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    code = "rate_limit_error" if exc.status == 429 else "invalid_request_error"
    return error_response(exc.status, str(exc), code, headers=headers)


async def start(request: web.Request) -> web.Response:
    denied = _authorize(request)
    if denied is not None:
        return denied
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):
        return error_response(400, "request body is not valid JSON")
    try:
        capture = request.app[PROFILE].request(body)
    except ProfileError as exc:
        return _error(exc)
    return web.json_response(capture.public(), status=202)


async def listing(request: web.Request) -> web.Response:
    denied = _authorize(request)
    if denied is not None:
        return denied
    capture = request.app[PROFILE]
    return web.json_response({"captures": capture.captures(),
                              "next_allowed_in_s": round(capture.next_allowed_in_s(), 3)})


async def show(request: web.Request) -> web.Response:
    denied = _authorize(request)
    if denied is not None:
        return denied
    capture_id = request.match_info["id"]
    found = request.app[PROFILE].get(capture_id)
    if found is None:
        return error_response(404, f"no capture {capture_id!r} (GET /admin/profile lists them)", "not_found")
    return web.json_response(found.public())


async def trace(request: web.Request) -> web.StreamResponse:
    denied = _authorize(request)
    if denied is not None:
        return denied
    try:
        path = request.app[PROFILE].trace_file(request.match_info["id"])
    except ProfileError as exc:
        return _error(exc)
    if not os.path.isfile(path):
        return error_response(410, "the trace file is gone from --profile.dir")
    # Sent from the file by aiohttp (sendfile where it can), not read into the event loop's memory.
    return web.FileResponse(path, headers={"Content-Type": "application/json"})


def add_routes(app: web.Application, capture: ProfileCapture | None) -> None:
    """Register the routes (they answer 404 when ``capture`` is None: captures are off)."""
    if capture is not None:
        app[PROFILE] = capture
    app.router.add_post("/admin/profile", start)
    app.router.add_get("/admin/profile", listing)
    app.router.add_get("/admin/profile/{id}", show)
    app.router.add_get("/admin/profile/{id}/trace", trace)
