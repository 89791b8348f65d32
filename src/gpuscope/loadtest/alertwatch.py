"""Reading alerts back: the receiver's notifications, Alertmanager's and Prometheus's alert lists.

The receiver (``gpuscope receiver``) answers ``GET /alerts`` with
``{"notifications": [{"received_at": <unix s>, "notification": <Alertmanager webhook body>}]}``;
that is where an alert "reaches" people, so detection latency is measured to it.
Pure functions here pick alerts out of those lists; :class:`AlertSources` fetches them.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Seen:
    """One firing alert in one notification."""

    received_at: float
    alertname: str
    labels: dict[str, str]
    starts_at: float | None

    @property
    def identity(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self.labels.items()))


def parse_time(text: str | None) -> float | None:
    """RFC 3339 (Alertmanager's ``startsAt``) → unix seconds; None for absent or zero times."""
    if not text or text.startswith("0001-"):
        return None
    cleaned = text.replace("Z", "+00:00")
    if "." in cleaned:  # Python < 3.11 takes at most 6 fractional digits
        head, _, tail = cleaned.partition(".")
        digits = "".join(ch for ch in tail if ch.isdigit())
        zone = tail[len(digits):]
        cleaned = f"{head}.{digits[:6]}{zone}"
    return dt.datetime.fromisoformat(cleaned).timestamp()


def firing(records: Iterable[dict[str, Any]], since: float, until: float = float("inf")) -> list[Seen]:
    """Every firing alert in notifications received in [since, until), in arrival order."""
    seen: list[Seen] = []
    for record in records:
        received = float(record["received_at"])
        if not since <= received < until:
            continue
        for alert in record["notification"].get("alerts", []):
            if alert.get("status") != "firing":
                continue
            labels = alert.get("labels", {})
            starts = parse_time(alert.get("startsAt"))
            seen.append(Seen(received, labels.get("alertname", ""), labels, starts))
    return sorted(seen, key=lambda s: s.received_at)


def first_of(records: Iterable[dict[str, Any]], names: Iterable[str], since: float) -> Seen | None:
    """The first firing notification since ``since`` of an alert named in ``names``."""
    wanted = set(names)
    return next((s for s in firing(records, since) if s.alertname in wanted), None)


def distinct(seen: Iterable[Seen]) -> list[Seen]:
    """One entry per alert (name and labels): repeated notifications of one alert count once."""
    out: dict[tuple[tuple[str, str], ...], Seen] = {}
    for s in seen:
        out.setdefault(s.identity, s)
    return list(out.values())


def groups_resolved(records: Iterable[dict[str, Any]]) -> bool:
    """True when the last notification of every Alertmanager group said ``resolved``."""
    last: dict[str, str] = {}
    for record in records:
        notification = record["notification"]
        last[notification.get("groupKey", "")] = notification.get("status", "")
    return all(status == "resolved" for status in last.values())


def rule_for_s(rules: Iterable[dict[str, Any]], name: str, labels: dict[str, str] | None = None) -> float:
    """``for`` (seconds) of the rule that raised an alert: same name, and its labels (severity, ...)
    among the alert's; one name can have several rules (a page and a ticket)."""
    candidates = [r for r in rules if r["name"] == name
                  and all((labels or {}).get(k) == v for k, v in r.get("labels", {}).items())]
    if not candidates:
        candidates = [r for r in rules if r["name"] == name]
    return min((float(r.get("duration", 0)) for r in candidates), default=0.0)


def _get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@dataclass(frozen=True)
class AlertSources:
    """Where to read alerts from: the receiver, Alertmanager and Prometheus base URLs."""

    receiver: str
    alertmanager: str
    prometheus: str

    def notifications(self) -> list[dict[str, Any]]:
        return _get_json(self.receiver + "/alerts")["notifications"]

    def alertmanager_alerts(self) -> list[dict[str, Any]]:
        """Alerts Alertmanager holds that are not resolved (active, inhibited or silenced)."""
        return _get_json(self.alertmanager + "/api/v2/alerts")

    def prometheus_alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts of Prometheus's rules."""
        return _get_json(self.prometheus + "/api/v1/alerts")["data"]["alerts"]

    def alert_rules(self) -> tuple[list[dict[str, Any]], float]:
        """Prometheus's alerting rules (name, duration = ``for`` in seconds, labels), and the
        longest evaluation interval of their groups."""
        groups = _get_json(self.prometheus + "/api/v1/rules?type=alert")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules, max((float(g.get("interval", 0)) for g in groups), default=0.0)

    def quiet(self) -> bool:
        """Nothing pending or firing anywhere, and every group's last notification was resolved."""
        return (not self.prometheus_alerts() and not self.alertmanager_alerts()
                and groups_resolved(self.notifications()))
