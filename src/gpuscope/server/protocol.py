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

from .config import OTHER, ServerConfig, UnknownTenant
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


#: Most stop strings per request, and longest one, in characters (OpenAI allows 4; vLLM sets no limit).
MAX_STOPS = 16
MAX_STOP_CHARS = 256

#: Fields of either API that are accepted and ignored: they tune sampling or bookkeeping, and the answer
#: keeps its shape without them (docs/server.md lists them).
IGNORED_FIELDS = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "seed", "user", "logit_bias", "min_tokens", "skip_special_tokens",
                  "spaces_between_special_tokens", "include_stop_str_in_output", "parallel_tool_calls")


@dataclass(frozen=True)
class Completion:
    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    stream: bool
    #: vLLM's sampling parameter: keep generating past end-of-sequence tokens, up to max_tokens.
    ignore_eos: bool = False
    #: Stop strings: generation ends before the first one found in the output, which never includes it.
    stop: tuple[str, ...] = ()
    #: ``stream_options.include_usage``: a last chunk with ``choices: []`` and ``usage`` (chat only).
    include_usage: bool = False


def parse_traceparent(header: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent`` header, else None (an invalid one is ignored).
    Hex is lowercase only (W3C Trace Context: uppercase is invalid, and a new trace starts)."""
    if not header:
        return None
    match = _TRACEPARENT.match(header.strip())
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
    if config.unknown_tenant == UnknownTenant.OTHER:
        return OTHER
    names = ", ".join(t.name for t in config.tenants)
    shown = header if len(header) <= 64 else header[:64] + "…"
    raise BadRequest(400, f"unknown tenant {shown!r} in X-Tenant; configured: {names}", param="X-Tenant")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ModelNotFound(BadRequest):
    """A ``model`` that is not the one served: 404 in vLLM's shape (its ``_check_model``)."""

    def __init__(self, model: str) -> None:
        shown = model if len(model) <= 64 else model[:64] + "…"
        super().__init__(404, f"The model `{shown}` does not exist.", "NotFoundError", "model")


def check_model(body: dict, config: ServerConfig) -> None:
    """``model`` may be left out (the served model answers), else it must name the served model."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string", param="model")
    if model != config.model_name:
        raise ModelNotFound(model)


def parse_stop(body: dict) -> tuple[str, ...]:
    """``stop``: null, a string or a list of strings (empty strings are dropped, as OpenAI does)."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOPS:
        raise BadRequest(400, f"'stop' has {len(stop)} strings; at most {MAX_STOPS}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(400, f"a 'stop' string is longer than {MAX_STOP_CHARS} characters", param="stop")
    return tuple(dict.fromkeys(s for s in stop if s))


def reject_unsupported(body: dict) -> None:
    """400 for fields whose request would change the answer's content or shape in ways not served."""
    for field, ok in (("logprobs", lambda v: v in (None, False)), ("top_logprobs", lambda v: v in (None, 0)),
                      ("echo", lambda v: v in (None, False)), ("best_of", lambda v: v in (None, 1)),
                      ("suffix", lambda v: v in (None, "")), ("prompt_logprobs", lambda v: v is None),
                      ("tools", lambda v: v in (None, [])), ("tool_choice", lambda v: v in (None, "none")),
                      ("response_format", lambda v: v is None or v == {"type": "text"}),
                      ("guided_json", lambda v: v is None), ("guided_regex", lambda v: v is None),
                      ("guided_choice", lambda v: v is None), ("guided_grammar", lambda v: v is None)):
        if field in body and not ok(body[field]):
            raise BadRequest(400, f"'{field}' is not supported by this server (leave it out or null)",
                             param=field)


def parse_sampling(body: dict, config: ServerConfig) -> tuple[float, bool, bool, tuple[str, ...], bool]:
    """(temperature, stream, ignore_eos, stop, include_usage), the fields both APIs share."""
    check_model(body, config)
    reject_unsupported(body)
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or not 0 <= temperature <= 2:
        raise BadRequest(400, "'temperature' must be a number between 0 and 2", param="temperature")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be true or false", param="stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(400, "'ignore_eos' must be true or false", param="ignore_eos")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if n != 1 or isinstance(n, bool):
        raise BadRequest(400, "only 'n' = 1 is supported", param="n")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:  # ignored without streaming (vLLM rejects it; clients that always send it work)
        if not isinstance(options, dict):
            raise BadRequest(400, "'stream_options' must be an object", param="stream_options")
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise BadRequest(400, "'stream_options.include_usage' must be true or false",
                             param="stream_options")
    return float(temperature), stream, ignore_eos, parse_stop(body), include_usage and stream


def parse_max_tokens(value: Any, config: ServerConfig, param: str = "max_tokens") -> int:
    if not _is_int(value):
        raise BadRequest(400, f"'{param}' must be an integer", param=param)
    if not 1 <= value <= config.max_tokens_limit:
        limit = config.max_tokens_limit
        raise BadRequest(400, f"'{param}' must be between 1 and {limit}, got {value}", param=param)
    return value


def encode_prompt(prompt: str, max_tokens: int, config: ServerConfig, param: str = "prompt") -> list[int]:
    """The API's ids of ``prompt`` (``model.encode``), 400 when they and ``max_tokens`` exceed the context."""
    try:
        ids = encode(prompt)
    except UnicodeEncodeError:
        raise BadRequest(400, f"'{param}' is not valid Unicode (lone surrogate)", param=param) from None
    context = config.model.context
    if len(ids) + max_tokens > context:
        raise BadRequest(400, f"prompt is {len(ids)} tokens and max_tokens is {max_tokens}; together they "
                              f"exceed the model's context of {context} tokens", param=param)
    return ids


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
    temperature, stream, ignore_eos, stop, include_usage = parse_sampling(body, config)
    max_tokens = body.get("max_tokens", 16)
    max_tokens = parse_max_tokens(16 if max_tokens is None else max_tokens, config)
    ids = encode_prompt(prompt, max_tokens, config)
    return Completion(prompt, ids, max_tokens, temperature, stream, ignore_eos, stop, include_usage)
