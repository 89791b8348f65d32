"""The API's error body (OpenAI's shape), shared by the routes of ``api`` and ``profile.api``."""

from __future__ import annotations

from aiohttp import web


def error_response(status: int, message: str, code: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": code, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)
