"""The receiver's profile trigger: a firing latency or composite alert asks its server for a profile.

For each alert of a notification that is firing and named in ``alerts`` (by default the latency
alerts and their composite), the trigger reads the alert's ``instance`` label and looks it up in
the configured servers: an allow-list mapping instance labels to base URLs. Only a listed instance
is called (``POST <url>/admin/profile`` with the server's profile token); an alert label never
chooses a host. One call per instance per notification, with a short timeout. What came of it goes
into the receiver's record of the notification (``profiles``): the capture's id and the trace's URL,
or why there is none. The server's rate limit (one capture per interval) decides repeats:
Alertmanager re-sends a firing group every ``repeat_interval``, and those calls get 429
(``rate_limited``) until the interval has passed.

The servers file (``--receiver.profile-servers``) is JSON::

    {"servers": {"server:8000": "http://server:8000"},
     "alerts": ["GPUKernelLatencySpike", "GPUStepLatencySpike", "GPURequestLatencySpike",
                "GPUServiceDegraded"],
     "steps": 16}

``alerts`` and ``steps`` are optional. The token comes from ``--receiver.profile-token-file`` or
``GPUSCOPE_PROFILE_TOKEN``. Standard library only, like the receiver.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue

#: The alerts that ask for a profile unless the file names others: the latency alerts and their
#: composite (names as ``gpuscope.alerting`` defines them; a test keeps the two in step, so the
#: receiver need not import the rule generator).
DEFAULT_ALERTS = ("GPUKernelLatencySpike", "GPUStepLatencySpike", "GPURequestLatencySpike",
                  "GPUServiceDegraded")
RESULTS = ("requested", "rate_limited", "refused", "unreachable", "not_allowed")
TOKEN_ENV = "GPUSCOPE_PROFILE_TOKEN"
MAX_STEPS = 256


class TriggerConfigError(ValueError):
    """A servers file or token that cannot work; one line."""


@dataclass(frozen=True)
class TriggerConfig:
    servers: Mapping[str, str]  # instance label → base URL
    token: str
    alerts: frozenset[str] = frozenset(DEFAULT_ALERTS)
    steps: int = 16
    timeout_s: float = 2.0


def load_config(path: str, token_file: str | None, environ: Mapping[str, str]) -> TriggerConfig:
    """Read and check the servers file and the token; TriggerConfigError naming what is wrong."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as exc:
        raise TriggerConfigError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise TriggerConfigError(f"{path} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("servers"), dict) or not raw["servers"]:
        raise TriggerConfigError(f'{path}: needs {{"servers": {{"<instance label>": "http://host:port"}}}}')
    unknown = sorted(set(raw) - {"servers", "alerts", "steps"})
    if unknown:
        raise TriggerConfigError(f"{path}: unknown key {unknown[0]!r} (servers, alerts, steps)")
    servers: dict[str, str] = {}
    for instance, url in raw["servers"].items():
        parts = urlsplit(url) if isinstance(url, str) else None
        if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
                or parts.path.strip("/")):
            raise TriggerConfigError(f"{path}: server {instance!r} must map to a base URL like "
                                     f"http://host:port, got {url!r}")
        servers[instance] = url.rstrip("/")
    alerts = raw.get("alerts", list(DEFAULT_ALERTS))
    if not isinstance(alerts, list) or not alerts or not all(isinstance(a, str) and a for a in alerts):
        raise TriggerConfigError(f"{path}: alerts must be a non-empty list of alert names")
    steps = raw.get("steps", 16)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise TriggerConfigError(f"{path}: steps must be a whole number between 1 and {MAX_STEPS}")
    token = environ.get(TOKEN_ENV, "")
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise TriggerConfigError(f"cannot read the profile token file {token_file}: "
                                     f"{exc.strerror}") from None
    if not token:
        raise TriggerConfigError(f"profile requests need the servers' token: --receiver.profile-token-file "
                                 f"or {TOKEN_ENV}")
    return TriggerConfig(servers, token, frozenset(alerts), steps)


class ProfileTrigger:
    """Asks allow-listed servers for profiles on firing alerts (module docstring). Thread-safe."""

    def __init__(self, config: TriggerConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self._results = catalogue.RECEIVER_PROFILE_REQUESTS.create(registry)
        for result in RESULTS:
            self._results.labels(result)

    def on_notification(self, notification: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The profiles asked for this (validated) notification: one entry per instance called or refused."""
        entries: list[dict[str, Any]] = []
        seen: set[str] = set()
        for alert in notification.get("alerts", []):
            labels = alert.get("labels", {})
            name = labels.get("alertname")
            status = alert.get("status", notification.get("status"))
            if status != "firing" or name not in self.config.alerts:
                continue
            instance = labels.get("instance")
            if not isinstance(instance, str) or instance in seen:
                continue
            seen.add(instance)
            base = self.config.servers.get(instance)
            if base is None:
                entry = {"alertname": name, "instance": instance, "result": "not_allowed",
                         "message": "instance is not in --receiver.profile-servers; no call made"}
            else:
                entry = {"alertname": name, "instance": instance, **self._ask(base, name, labels)}
            self._results.labels(entry["result"]).inc()
            entries.append(entry)
        return entries

    def _ask(self, base: str, alertname: str, labels: Mapping[str, Any]) -> dict[str, Any]:
        body = {"steps": self.config.steps, "reason": f"alert {alertname}",
                "alert": {str(k): str(v) for k, v in labels.items()}}
        request = urllib.request.Request(
            base + "/admin/profile", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.config.token}"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                answer = json.loads(response.read())
            return {"result": "requested", "id": answer["id"], "mode": answer.get("mode"),
                    "steps": answer.get("steps"), "trace_url": base + answer["trace_path"],
                    "status_url": base + answer["status_path"]}
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            result = "rate_limited" if exc.code == 429 else "refused"
            entry: dict[str, Any] = {"result": result, "status": exc.code, "message": message}
            if exc.headers.get("Retry-After"):
                entry["retry_after_s"] = exc.headers["Retry-After"]
            return entry
        except (OSError, ValueError, KeyError, TypeError) as exc:  # refused, timed out, or not our server
            return {"result": "unreachable", "message": f"{type(exc).__name__}: {exc}"[:300]}


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        return str(body["error"]["message"])[:300]
    except (OSError, ValueError, KeyError, TypeError):
        return f"HTTP {exc.code}"
