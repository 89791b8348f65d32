"""Request validation and W3C trace context for the HTTP API; pure functions, no aiohttp.

Every check returns or raises ``BadRequest`` with the HTTP status and a message
that names the problem, which the API turns into a JSON error body.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from .config import OTHER, ServerConfig
from .model import encode

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.code, "param": self.param,
                          "code": self.status}}


@dataclass(frozen=True)
class Completion:
    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    stream: bool
    #: vLLM's sampling parameter: keep generating past end-of-sequence tokens, up to max_tokens.
    ignore_eos: bool = False


def parse_traceparent(header: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent`` header, else None (an invalid one is ignored)."""
    if not header:
        return None
    match = _TRACEPARENT.match(header.strip().lower())
    if not match:
        return None
    version, trace_id, parent_id, _flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return trace_id


def new_trace_id() -> str:
    return secrets.token_hex(16)


def traceparent(trace_id: str) -> str:
    """Our span's ``traceparent`` for the response: same trace, a fresh span id, sampled."""
    return f"00-{trace_id}-{secrets.token_hex(8)}-01"


def resolve_tenant(config: ServerConfig, header: str | None) -> str:
    """Tenant of a request from ``X-Tenant``: the default without it, ``other`` or 400 for unknown ones."""
    if header is None or header == "":
        return config.default_tenant
    if config.tenant(header) is not None:
        return header
    if config.unknown_tenant == OTHER:
        return OTHER
    names = ", ".join(t.name for t in config.tenants)
    shown = header if len(header) <= 64 else header[:64] + "…"
    raise BadRequest(400, f"unknown tenant {shown!r} in X-Tenant; configured: {names}", param="X-Tenant")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_completion(body: Any, config: ServerConfig) -> Completion:
    """Validate a /v1/completions body (already JSON-decoded). Unknown fields are ignored."""
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    if "prompt" not in body:
        raise BadRequest(400, "missing required field 'prompt'", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI clients may send a one-element list
    if not isinstance(prompt, str):
        raise BadRequest(400, "'prompt' must be a string", param="prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string", param="model")
    max_tokens = body.get("max_tokens", 16)
    if not _is_int(max_tokens):
        raise BadRequest(400, "'max_tokens' must be an integer", param="max_tokens")
    if not 1 <= max_tokens <= config.max_tokens_limit:
        limit = config.max_tokens_limit
        raise BadRequest(400, f"'max_tokens' must be between 1 and {limit}, got {max_tokens}",
                         param="max_tokens")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or not 0 <= temperature <= 2:
        raise BadRequest(400, "'temperature' must be a number between 0 and 2", param="temperature")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be true or false", param="stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(400, "'ignore_eos' must be true or false", param="ignore_eos")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise BadRequest(400, "only 'n' = 1 is supported", param="n")
    try:
        ids = encode(prompt)
    except UnicodeEncodeError:
        raise BadRequest(400, "'prompt' is not valid Unicode (lone surrogate)", param="prompt") from None
    context = config.model.context
    if len(ids) + max_tokens > context:
        raise BadRequest(400, f"prompt is {len(ids)} tokens and max_tokens is {max_tokens}; together they "
                              f"exceed the model's context of {context} tokens", param="prompt")
    return Completion(prompt, ids, max_tokens, float(temperature), stream, ignore_eos)
