"""``gpuscope generate [--check] [--root DIR]``: write every generated file from its one source.

The way a monitoring mixin has one ``make generate``: each generator below returns
{path relative to the repository root: content}, and this command writes them (or, with
``--check``, writes nothing and exits 1 naming every stale or orphaned file; CI runs that).

=============  ==========================================================================
alerting       Prometheus and Loki rule files and Alertmanager configs of both profiles
               (``alerts/``), ``docs/alerts.md`` — from ``gpuscope.alerting``
dashboards     ``dashboards/json/<uid>.json`` and Grafana's datasource provisioning — from
               ``gpuscope.dashboards``
docs           ``docs/sources.md`` (what each source feeds) — from ``gpuscope.docgen``, which reads
               the rules and dashboards above
metrics        ``docs/metrics.md`` — from ``gpuscope.contract.catalogue``
tracing        the compose stack's OpenTelemetry Collector configuration (its tail-sampling policy
               keeps errors and requests slower than the TTFT objective) — from the alert config,
               by ``gpuscope.otelcol``
fleet          the fleet profile's Grafana datasources (compose's, with VictoriaMetrics) — from
               ``gpuscope.dashboards``
kubernetes     ``deploy/kubernetes/generated/`` (PrometheusRule, ServiceMonitors, Alertmanager
               Secret, dashboard ConfigMaps, HPA, prometheus-adapter rules) — from
               ``gpuscope.kube`` and the files above
=============  ==========================================================================

Generators run in this order: the Kubernetes objects embed the dashboards' JSON as written.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuscope.alerting import generate as alerting_generate
from gpuscope.contract import catalogue
from gpuscope.dashboards import render as dashboards_render
from gpuscope.docgen import sources as docgen_sources
from gpuscope.kube import generate as kube_generate
from gpuscope.otelcol import config as otelcol_config
from gpuscope.util.settings import SettingsParser, parser_for, setting

Generator = Callable[[Path], dict[str, str]]


def _alerting(root: Path) -> dict[str, str]:
    return alerting_generate.outputs()


def _dashboards(root: Path) -> dict[str, str]:
    return dashboards_render.outputs()


def _docs(root: Path) -> dict[str, str]:
    return docgen_sources.outputs()


def _metrics(root: Path) -> dict[str, str]:
    return {"docs/metrics.md": catalogue.render_markdown()}


def _tracing(root: Path) -> dict[str, str]:
    return otelcol_config.outputs()


def _fleet(root: Path) -> dict[str, str]:
    return dashboards_render.fleet_outputs()


def _kubernetes(root: Path) -> dict[str, str]:
    return {str(path): text for path, text in kube_generate.generate(root).items()}


#: name → (generator, folders whose every file it owns: a file there it does not make is an orphan)
GENERATORS: dict[str, tuple[Generator, tuple[str, ...]]] = {
    "alerting": (_alerting, ("alerts",)),
    "dashboards": (_dashboards, ("dashboards/json",)),
    "docs": (_docs, ()),
    "metrics": (_metrics, ()),
    "tracing": (_tracing, ()),
    "fleet": (_fleet, ()),
    "kubernetes": (_kubernetes, ("deploy/kubernetes/generated",)),
}


def run(root: Path, check: bool, only: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Write (or check) every generator's files under ``root``; return (stale, orphans)."""
    stale: list[str] = []
    orphans: list[str] = []
    for name, (generate, owned) in GENERATORS.items():
        if only and name not in only:
            continue
        files = generate(root)
        for rel, text in files.items():
            path = root / rel
            if path.exists() and path.read_text() == text:
                continue
            stale.append(rel)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        for folder in owned:
            for path in sorted((root / folder).rglob("*")):
                rel = str(path.relative_to(root))
                if path.is_file() and rel not in files:
                    orphans.append(rel)
                    if not check:
                        path.unlink()
    return stale, orphans


@dataclass(frozen=True)
class GenerateSettings:
    """The flags of ``gpuscope generate``; ``--check`` and ``--only`` are per run, with no variable."""

    root: Path = setting("--root", Path("."), "the repository root to write into (default: the current "
                         "directory)", parse=Path)
    check: bool = setting("--check", False, "write nothing; exit 1 naming stale or orphaned files", env=False)
    only: str = setting("--only", "", f"comma-separated subset of {', '.join(GENERATORS)}", env=False)


def build_parser() -> SettingsParser[GenerateSettings]:
    return parser_for(GenerateSettings, prog="gpuscope generate", description=__doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_settings(sys.argv[1:] if argv is None else argv)
    root = args.root.resolve()
    only = tuple(part for part in args.only.split(",") if part)
    unknown = set(only) - set(GENERATORS)
    if unknown:
        parser.error(f"--only: unknown generator(s) {', '.join(sorted(unknown))}")
    if not (root / "src" / "gpuscope").is_dir():
        parser.error(f"--root {root} is not a gpuscope checkout (no src/gpuscope/ there)")
    stale, orphans = run(root, args.check, only)
    verb = "stale" if args.check else "wrote"
    for rel in stale:
        print(f"{verb}: {rel}", file=sys.stderr if args.check else sys.stdout)
    for rel in orphans:
        print(f"orphan: {rel} has no source" + ("" if args.check else " (removed)"),
              file=sys.stderr if args.check else sys.stdout)
    if args.check and (stale or orphans):
        print("run `gpuscope generate` and commit the result", file=sys.stderr)
        return 1
    return 0
