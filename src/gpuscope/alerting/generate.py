"""Every generated alerting file, for ``gpuscope generate``.

Files (paths relative to the repository root) for each profile in ``config.PROFILES``:

- ``alerts/prometheus/<profile>/gpuscope.rules.yml``: every alert and derived series, read from the
  normalised series only (the same whatever the sources);
- ``alerts/prometheus/<profile>/sources.rules.yml``: the normalisation layer of ``Profile.sources``,
  which compose, the fleet, Kubernetes and ``gpuscope stack`` load with the file above;
- ``alerts/sources/<profile>/<source>.rules.yml``: each known source's layer on its own, to load another
  choice (``gpuscope stack --stack.source vllm``, the per-source promtool tests);
- Loki ruler rules and the Alertmanager configuration;

plus ``docs/alerts.md`` (``docs/sources.md``, which also reads the dashboards, is ``gpuscope.docgen``'s).
"""

from __future__ import annotations

from gpuscope.alerting import (
    alertmanager,
    bottleneck,
    composite,
    docs,
    energy,
    health_rules,
    latency,
    log_rules,
    memory,
    scheduling,
    slo,
    sources,
)
from gpuscope.alerting.rules import Alert, Group, render_rule_file
from gpuscope.contract.profiles import PROFILES, Profile

#: Rule groups in evaluation order: the composite reads records of the groups before it.
PROMETHEUS_AREAS = (latency, slo, memory, scheduling, composite, health_rules, bottleneck, energy)


def consumer_groups(p: Profile) -> list[Group]:
    """Every alert and derived series, reading only normalised series."""
    return [g for area in PROMETHEUS_AREAS for g in area.groups(p)]


def source_groups(p: Profile) -> list[Group]:
    """The normalisation layer of the profile's sources."""
    return [sources.group(src, p) for src in sources.selected(p)]


def prometheus_groups(p: Profile) -> list[Group]:
    """Everything Prometheus evaluates, in evaluation order: the sources' layers first."""
    return [*source_groups(p), *consumer_groups(p)]


def group_order(p: Profile, source_names: tuple[str, ...] | None = None) -> list[str]:
    """Group names in evaluation order (promtool's ``group_eval_order``)."""
    chosen = [sources.SOURCES[n] for n in source_names] if source_names else sources.selected(p)
    return [*(sources.group(s, p).name for s in chosen), *(g.name for g in consumer_groups(p))]


def all_alerts(p: Profile) -> list[Alert]:
    """Every alert of a profile, Prometheus and Loki."""
    return [a for g in (*prometheus_groups(p), *log_rules.groups(p)) for a in g.alerts()]


def prometheus_rules_path(p: Profile) -> str:
    return f"alerts/prometheus/{p.name}/gpuscope.rules.yml"


def sources_rules_path(p: Profile) -> str:
    return f"alerts/prometheus/{p.name}/sources.rules.yml"


def source_rules_path(p: Profile, source: str) -> str:
    return f"alerts/sources/{p.name}/{source}.rules.yml"


def stack_rule_files(p: Profile, server_source: str) -> list[str]:
    """The rule files of a stack whose server is ``server_source`` beside gpuscope exporter: every alert
    and derived series, and the two sources' layers (``gpuscope stack --stack.source``)."""
    return [prometheus_rules_path(p), source_rules_path(p, server_source),
            source_rules_path(p, sources.GPUSCOPE_EXPORTER.name)]


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
        files[prometheus_rules_path(p)] = render_rule_file(consumer_groups(p), p, p.evaluation_interval)
        files[sources_rules_path(p)] = render_rule_file(source_groups(p), p, p.evaluation_interval)
        for src in sources.SOURCES.values():
            files[source_rules_path(p, src.name)] = render_rule_file([sources.group(src, p)], p,
                                                                     p.evaluation_interval)
        files[loki_rules_path(p)] = render_rule_file(log_rules.groups(p), p, None)
        files[alertmanager_path(p)] = alertmanager.render(p)
    files["docs/alerts.md"] = docs.render({name: all_alerts(p) for name, p in PROFILES.items()})
    return files
