"""Read the generated dashboards: panels, their queries, and Grafana's variable substitution."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuscope.contract import uids

ROOT = Path(__file__).resolve().parents[2]
JSON_DIR = ROOT / "dashboards" / "json"
UIDS = uids.ALL


@dataclass(frozen=True)
class Query:
    dashboard: str      # uid
    panel: str          # title
    panel_type: str
    datasource: str     # uid
    expr: str
    instant: bool
    format: str


def load(uid: str) -> dict:
    return json.loads((JSON_DIR / f"{uid}.json").read_text())


def dashboards() -> dict[str, dict]:
    return {uid: load(uid) for uid in UIDS}


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def queries(datasource_type: str | None = None) -> list[Query]:
    found = []
    for uid, dash in dashboards().items():
        for panel in panels(dash):
            for target in panel.get("targets", []):
                ds = target.get("datasource") or panel.get("datasource")
                if datasource_type and ds["type"] != datasource_type:
                    continue
                found.append(Query(uid, panel["title"], panel["type"], ds["uid"], target["expr"],
                                   bool(target.get("instant")), target.get("format", "time_series")))
    return found


def substitute(expr: str, rate_interval: str, interval: str, range_: str) -> str:
    """What Grafana sends: built-in intervals filled in, every dashboard variable at "All" (``.*``)."""
    expr = (expr.replace("$__rate_interval", rate_interval).replace("$__interval", interval)
            .replace("$__range", range_))
    return re.sub(r"\$(instance|gpu|op|tenant)\b", ".*", expr)
