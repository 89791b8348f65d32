"""Write every generated alerting file: ``python -m gpuscope.alerting.generate [--check]``.

Files (paths relative to the repository root) for each profile in ``config.PROFILES``:
Prometheus rules, Loki ruler rules and the Alertmanager configuration; plus ``docs/alerts.md``.
``--check`` writes nothing and exits 1, naming the files that differ from what would be generated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuscope.alerting import (
    alertmanager,
    bottleneck,
    composite,
    docs,
    health,
    latency,
    loki,
    memory,
    scheduling,
    slo,
)
from gpuscope.alerting.config import PROFILES, Profile
from gpuscope.alerting.rules import Alert, Group, render_rule_file

ROOT = Path(__file__).resolve().parents[3]
#: Rule groups in evaluation order: the composite reads records of the groups before it.
PROMETHEUS_AREAS = (latency, slo, memory, scheduling, composite, health, bottleneck)


def prometheus_groups(p: Profile) -> list[Group]:
    return [g for area in PROMETHEUS_AREAS for g in area.groups(p)]


def all_alerts(p: Profile) -> list[Alert]:
    """Every alert of a profile, Prometheus and Loki."""
    return [a for g in (*prometheus_groups(p), *loki.groups(p)) for a in g.alerts()]


def prometheus_rules_path(p: Profile) -> str:
    return f"alerts/prometheus/{p.name}/gpuscope.rules.yml"


def loki_rules_path(p: Profile) -> str:
    return f"alerts/loki/{p.name}/fake/gpuscope.rules.yml"


def alertmanager_path(p: Profile) -> str:
    if p.name == "production":
        return "alerts/alertmanager.yml"
    return f"alerts/alertmanager-{p.name}-profile.yml"


def outputs() -> dict[str, str]:
    """Path → content of every generated file."""
    files: dict[str, str] = {}
    for p in PROFILES.values():
        files[prometheus_rules_path(p)] = render_rule_file(prometheus_groups(p), p, p.evaluation_interval)
        files[loki_rules_path(p)] = render_rule_file(loki.groups(p), p, None)
        files[alertmanager_path(p)] = alertmanager.render(p)
    files["docs/alerts.md"] = docs.render({name: all_alerts(p) for name, p in PROFILES.items()})
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuscope.alerting.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    stale = []
    for rel, content in outputs().items():
        path = args.root / rel
        if path.exists() and path.read_text() == content:
            continue
        if args.check:
            stale.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        print(f"wrote {rel}")
    if stale:
        print("stale (run python -m gpuscope.alerting.generate): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
