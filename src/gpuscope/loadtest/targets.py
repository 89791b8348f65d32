"""Endpoints the comparison loads but does not start: ``--target NAME=URL[#MODEL]``.

A target is any server with vLLM's OpenAI-compatible routes: ``GET /v1/models``
and streaming ``POST /v1/completions`` or ``/v1/chat/completions``. A URL that names
one of those endpoints (``http://host:8000/v1/chat/completions``) is loaded through
it: that is the API its runs drive unless ``--load.api`` says otherwise. Its model is
the one named after ``#``, or else the first one ``/v1/models`` lists (what ``vllm serve MODEL`` serves).
Every target is asked for ``/v1/models`` before the first run, so a wrong URL or
a server that is down ends the command at once with one line, not after the
configurations that came before it have run.

``GPUSCOPE_LOAD_API_KEY``, when set, is sent as ``Authorization: Bearer KEY``
(``vllm serve --api-key``) by the probe here and by every Locust user. It is an
environment variable only, so it never appears in a command line or a report.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

API_KEY_ENV = "GPUSCOPE_LOAD_API_KEY"
MODELS_PATH = "/v1/models"
#: Target names become file names (``targets-NAME-r1``) and report rows.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class TargetError(Exception):
    """A target that cannot be used; the message is one line, fit for the user."""


@dataclass(frozen=True)
class Target:
    """An endpoint to load: its name in the report, its root URL, and the model to ask for ('' = ask it)."""

    name: str
    url: str
    model: str = ""
    #: The API its URL named (``chat`` or ``completions``); "" when it named none.
    api: str = ""


#: Endpoint paths a target URL may end with, and the API each is.
ENDPOINTS = (("/chat/completions", "chat"), ("/completions", "completions"))


def split_endpoint(url: str) -> tuple[str, str]:
    """``http://h/v1/chat/completions`` → (``http://h/v1``, ``chat``); naming no endpoint → (url, "")."""
    stripped = url.strip().rstrip("/")
    for suffix, api in ENDPOINTS:
        if stripped.endswith(suffix):
            return stripped[: -len(suffix)], api
    return url, ""


def base_url(url: str) -> str:
    """The server's root URL as Locust's ``--host`` wants it: no trailing ``/`` or ``/v1``.

    OpenAI clients take ``http://host:8000/v1`` as their base URL; the load test adds
    ``/v1/completions`` itself, so either form may be given.
    """
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    return url.rstrip("/")


def parse_target(spec: str) -> Target:
    """``NAME=URL`` or ``NAME=URL#MODEL`` → Target; raises ValueError with a one-line reason."""
    name, sep, rest = spec.partition("=")
    name = name.strip()
    if not sep or not rest.strip():
        raise ValueError(f"target {spec!r} is not NAME=URL or NAME=URL#MODEL")
    if not _NAME.match(name):
        raise ValueError(f"target name {name!r} must be letters, digits, '_', '.' or '-' (64 at most), "
                         "starting with a letter or digit")
    url, _, model = rest.partition("#")
    url, api = split_endpoint(url)
    url = base_url(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"target {name!r}: {url!r} is not an http:// or https:// URL")
    if parts.query:
        raise ValueError(f"target {name!r}: the URL {url!r} must not have a query")
    return Target(name, url, model.strip(), api)


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer KEY`` when ``GPUSCOPE_LOAD_API_KEY`` is set, else nothing."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def list_models(url: str, timeout_s: float = 10.0) -> list[str]:
    """Model ids that ``GET URL/v1/models`` lists, in its order; TargetError with the reason otherwise."""
    where = base_url(url) + MODELS_PATH
    request = urllib.request.Request(where, headers={"Accept": "application/json", **auth_headers()})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read(1 << 20)
    except urllib.error.HTTPError as exc:
        raise TargetError(f"GET {where}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TargetError(f"GET {where}: {reason}") from None
    try:
        data = json.loads(raw)
        models = [entry["id"] for entry in data["data"]]
    except (ValueError, KeyError, TypeError):
        raise TargetError(f"GET {where}: not an OpenAI model list ({raw[:80]!r})") from None
    if not all(isinstance(m, str) and m for m in models):
        raise TargetError(f"GET {where}: a model without an id")
    if not models:
        raise TargetError(f"GET {where}: the server lists no model")
    return models


def resolve_model(target: Target, timeout_s: float = 10.0) -> Target:
    """The target with its model: the one it named, which the server must list, or the server's first."""
    served = list_models(target.url, timeout_s)
    if not target.model:
        return Target(target.name, target.url, served[0])
    if target.model not in served:
        raise TargetError(f"{target.url} does not serve model {target.model!r} "
                          f"(it lists: {', '.join(served)})")
    return target
