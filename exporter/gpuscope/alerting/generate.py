"""Every generated alerting file, for ``gpuscope generate``.

Files (paths relative to the repository root) for each profile in ``config.PROFILES``:
Prometheus rules, Loki ruler rules and the Alertmanager configuration; plus ``docs/alerts.md``.
"""

from __future__ import annotations

from gpuscope.alerting import (
    alertmanager,
    bottleneck,
    composite,
    docs,
    health_rules,
    latency,
    log_rules,
    memory,
    scheduling,
    slo,
)
from gpuscope.alerting.config import PROFILES, Profile
from gpuscope.alerting.rules import Alert, Group, render_rule_file

#: Rule groups in evaluation order: the composite reads records of the groups before it.
PROMETHEUS_AREAS = (latency, slo, memory, scheduling, composite, health_rules, bottleneck)


def prometheus_groups(p: Profile) -> list[Group]:
    return [g for area in PROMETHEUS_AREAS for g in area.groups(p)]


def all_alerts(p: Profile) -> list[Alert]:
    """Every alert of a profile, Prometheus and Loki."""
    return [a for g in (*prometheus_groups(p), *log_rules.groups(p)) for a in g.alerts()]


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
        files[loki_rules_path(p)] = render_rule_file(log_rules.groups(p), p, None)
        files[alertmanager_path(p)] = alertmanager.render(p)
    files["docs/alerts.md"] = docs.render({name: all_alerts(p) for name, p in PROFILES.items()})
    return files
