"""docs/sources.md: what each source supports, computed from the generated rules and dashboards.

It reads both generators' output, so it sits above both (``gpuscope generate``'s ``docs``).

An alert (or a dashboard query) is supported by a source when every normalised series it needs is
recorded by that source's layer. "Needs" follows derived series back to the normalised ones they read
(a burn rate needs the SLO inputs; a p99 the bucket rates), and leaves out what follows ``unless``
(what must be absent is not needed). The composite is reported per dimension: a dimension is there
when either of its conditions is supported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from gpuscope.alerting import composite, log_rules, sources
from gpuscope.alerting.generate import consumer_groups
from gpuscope.alerting.rules import Alert
from gpuscope.contract.profiles import PRODUCTION, Profile
from gpuscope.dashboards import MODULES
from gpuscope.dashboards import render as dashboards

NORMALISED = re.compile(r"\bgpuscope:[a-z0-9_]+:[a-z0-9_]+\b")
RAW = re.compile(r"(?<![\w:])([A-Za-z_][\w:]*)(?=\{)")
YES, NO, ANY = "✓", "—", "any"
SERVER = (sources.GPUSCOPE_SERVER.name, sources.VLLM.name, sources.GPUSCOPE_SHARE.name)
GPU = (sources.GPUSCOPE_EXPORTER.name, sources.DCGM_EXPORTER.name)


def _branches(expr: str) -> list[set[str]]:
    """The normalised series each alternative of an expression needs: ``or`` splits alternatives, and
    what follows ``unless`` in one is not needed (it must be absent). Alternatives that read no
    normalised series (``vector(0)``) are left out."""
    needed = [set(NORMALISED.findall(branch.split("unless")[0])) for branch in re.split(r"\bor\b", expr)]
    return [names for names in needed if names]


class Support:
    """Which normalised series each source records, and what every derived series reads."""

    def __init__(self, p: Profile) -> None:
        self.recorded = {name: {r.record for r in sources.records(src, p)}
                         for name, src in sources.SOURCES.items()}
        #: derived series → the alternatives of every rule recording it
        self.derived: dict[str, list[set[str]]] = {}
        for group in consumer_groups(p):
            for rule in group.rules:
                if not isinstance(rule, Alert):
                    self.derived.setdefault(rule.record, []).extend(_branches(rule.expr))
        self.alerts = [a for g in consumer_groups(p) for a in g.alerts()]
        self.conditions = composite.conditions(p)
        self.profile = p

    def _has(self, source: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name not in self.derived:
            return name in self.recorded[source]
        return name not in seen and any(all(self._has(source, n, seen | {name}) for n in branch)
                                        for branch in self.derived[name])

    def supports(self, source: str, expr: str) -> bool | None:
        """Whether the source's layer feeds the expression (some alternative has every series it needs);
        None when the expression reads no normalised series (node_exporter, Prometheus' own)."""
        branches = _branches(expr)
        if not branches:
            return None
        return any(all(self._has(source, n) for n in branch) for branch in branches)

    def reads_none_of(self, source: str, expr: str) -> bool:
        """True when no series the expression reads (through derived ones) comes from the source."""
        def leaves(name: str, seen: frozenset[str]) -> set[str]:
            if name not in self.derived:
                return {name}
            return {leaf for branch in self.derived[name] for n in branch - seen
                    for leaf in leaves(n, seen | {name})}

        names = {leaf for branch in _branches(expr) for n in branch for leaf in leaves(n, frozenset())}
        return bool(names) and not names & self.recorded[source]

    def dimensions(self, source: str) -> list[str]:
        return [dim for dim, cond in self.conditions.items()
                if any(self.supports(source, branch) for branch in cond.split("\nor\n"))]


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _mark(value: bool | None) -> str:
    return ANY if value is None else YES if value else NO


def _alert_rows(s: Support) -> list[str]:
    lines = [_row(("alert", *SERVER, *GPU)), _row(["---"] * (1 + len(SERVER) + len(GPU)))]
    seen: set[tuple] = set()
    loki = [a for g in log_rules.groups(s.profile) for a in g.alerts()]
    for alert in [*s.alerts, *loki]:
        key = (alert.name, tuple(alert.labels.items()), alert.severity)
        if key in seen:
            continue
        seen.add(key)
        name = alert.name + "".join(f" `{k}={v}`" for k, v in alert.labels.items())
        if sum(a.name == alert.name and a.labels == alert.labels for a in s.alerts) > 1:
            name += f" ({alert.severity})"
        if alert.name == composite.COMPOSITE:
            cells = []
            for src in (*SERVER, *GPU):
                dims = s.dimensions(src) if src in SERVER else []
                cells.append(f"{YES} {len(dims)} of {len(s.conditions)}: {', '.join(dims)}"
                             if src in SERVER else NO)
        elif alert in loki:
            cells = [YES if src == sources.GPUSCOPE_SERVER.name else NO for src in (*SERVER, *GPU)]
            name += " (Loki)"
        else:
            cells = [_mark(s.supports(src, alert.expr)) for src in (*SERVER, *GPU)]
        lines.append(_row((name, *cells)))
    return lines


def _panel_rows(s: Support) -> list[str]:
    lines = [_row(("dashboard", "panel", *SERVER, *GPU)), _row(["---"] * (2 + len(SERVER) + len(GPU)))]
    for module in MODULES:
        uid, text = dashboards.dashboard_json(module)
        for panel in json.loads(text)["panels"]:
            exprs = [t["expr"] for t in panel.get("targets", []) if t["datasource"]["type"] == "prometheus"]
            if not exprs:
                # Loki: our own logs
                cells = [YES if src == sources.GPUSCOPE_SERVER.name else NO for src in (*SERVER, *GPU)]
            else:
                cells = []
                for src in (*SERVER, *GPU):
                    marks = [s.supports(src, e) for e in exprs]
                    cells.append(ANY if all(m is None for m in marks) else _mark(any(m for m in marks)))
            lines.append(_row((f"`{uid}`", panel["title"], *cells)))
    return lines


def _mapping_rows(p: Profile) -> list[str]:
    lines = [_row(("normalised series", *SERVER, *GPU)), _row(["---"] * (1 + len(SERVER) + len(GPU)))]
    found: dict[str, dict[str, set[str]]] = {}
    for name, src in sources.SOURCES.items():
        for record in sources.records(src, p):
            found.setdefault(record.record, {}).setdefault(name, set()).update(RAW.findall(record.expr))
    for record, by_source in found.items():
        cells = [", ".join(f"`{m}`" for m in sorted(by_source[src])) if src in by_source else NO
                 for src in (*SERVER, *GPU)]
        lines.append(_row((f"`{record}`", *cells)))
    return lines


def render(p: Profile) -> str:
    s = Support(p)
    notes = []
    for src in sources.SOURCES.values():
        notes += [f"### {src.name}: {src.title}", "", f"Follows {src.upstream}.", ""]
        notes += [f"- {note}" for note in src.notes] or ["- Its own metrics: every normalised series it "
                                                          "has is a rename-free copy or rate."]
        notes.append("")
    table = [_row(("source", "role", "job matcher (`Selectors`)", "layer")), _row(["---"] * 4)]
    table += [_row((f"`{src.name}`", src.role, f"`{src.selector_field}`: `{src.selector(p)}`",
                    f"`alerts/sources/<profile>/{src.name}.rules.yml`")) for src in sources.SOURCES.values()]
    return "\n".join([INTRO.replace("SOURCES_TABLE", "\n".join(table)), "", *notes, END_TO_END,
                      "## Alerts per source", "", ALERTS_NOTE, "", *_alert_rows(s), "",
                      "## Dashboard panels per source", "", PANELS_NOTE, "", *_panel_rows(s), "",
                      "## Normalised series and what each source records them from", "",
                      *_mapping_rows(p), ""])


INTRO = """\
# Sources: the same alerts and dashboards on gpuscope, vLLM and dcgm-exporter series

Generated by `gpuscope generate` from `src/gpuscope/alerting/sources.py` and the rules and
dashboards built on it; do not edit.

Every alert, the composite, the SLO burn rates, the bottleneck classes and every dashboard panel read
*normalised series* (`gpuscope:<what>:<aggregation>`, named in `src/gpuscope/contract/names.py`). A
*source* is a program whose metrics become those series, through its own layer of recording rules:

SOURCES_TABLE

`Profile.sources` in `src/gpuscope/contract/profiles.py` picks the ones that run (default:
`gpuscope-server` and `gpuscope-exporter`); their layers are
`alerts/prometheus/<profile>/sources.rules.yml`, which compose, the fleet profile, Kubernetes and
`gpuscope stack` load beside `gpuscope.rules.yml`. Several of one role run together (a fleet with
gpuscope servers and vLLM): each layer records the same series under its own `job`. To run another
choice, load `gpuscope.rules.yml` and the layers you need from `alerts/sources/<profile>/` (what
`gpuscope stack --stack.source vllm` does), or set `Profile.sources` and run `gpuscope generate`.

## Why the layer records first aggregations, not copies

The obvious layer copies every raw series under a normalised name (`gpuscope:request_ttft_seconds_bucket
= gpuscope_request_ttft_seconds_bucket`). For gpuscope's own server that would store every bucket series
twice, and the rules would still compute the same rates on the copies. Instead each layer records the
*first aggregation every consumer reads*, straight from the source's metrics:

- histograms: bucket and count rates over the latency window, per tenant (and op/device): the p50/p99
  records, the spike alerts, the queue-wait alert and every latency panel read them;
- counters: rates over the window of the alert that reads them (tokens over the starvation window,
  clock-event seconds over the throttle window), SLO inputs per burn-rate window;
- gauges: one series per canonical label set (for gpuscope a copy; for vLLM summed over engines, but
  waiting requests kept per engine for starvation; for dcgm-exporter maxed over its identity labels
  and scaled to base units);
- memory: the floor growth and headroom the leak alerts compare, computed on the raw gauge so the floors
  see every scrape.

For the gpuscope source the rules therefore compute no more than before: each bucket rate is computed
once per evaluation and read by the p50, p99 and sample-rate records, where the old rules computed it
twice; the series added are the recorded rates themselves (one per bucket series the dashboards and
alerts use) and small gauge copies. The alerts' values are unchanged: the promtool cases of the default
sources pass as they did, and the normalised layer of each source is evaluated first
(`group_eval_order`; in Prometheus a later group may read it up to one evaluation interval late).

What this costs: dashboards show rates over the rule windows (5 m in production, 20 s in the test
profile), the same rates the alerts see, instead of `$__rate_interval`; and recorded series carry no
exemplars, so latency panels no longer link a heatmap cell to a trace. Exemplars stay in Prometheus:
Explore on `gpuscope_request_ttft_seconds_bucket` still opens a request's trace and logs."""

END_TO_END = """\
## End to end with the vLLM source

`gpuscope serve --metrics.names vllm` exposes the reference server's serving metrics as vLLM's V1
engine does (names, types, `model_name` and `engine` labels, bucket layouts, `finished_reason`), with
no kernel-timing or tenant series; `gpuscope stack --stack.source vllm` runs it scraped as job `vllm`,
with Prometheus loading `gpuscope.rules.yml`, the vLLM layer and gpuscope exporter's layer. The
dashboard proof runs on it (`tests/dashboards/test_live_vllm.py`: what the table below says vLLM feeds
shows data, what it does not stays empty), and so does the alert drill:
`python -m gpuscope.loadtest.fault_drill --source vllm` injects a latency spike (seen as
GPUStepLatencySpike), a starved tenant (the only tenant under load, so the model stalls, as vLLM's one
queue would) and an error burst, and writes `benchmarks/results/alerts-vllm-cpu.json`. A memory leak
has no vLLM series to move, and the composite's two dimensions the drill can move there exclude each
other on one model (tokens flow or they do not), so promtool proves the vLLM composite
(`tests/alerts/cases/sources/vllm.test.yml`: inter-token latency and a KV cache that preempts).
"""

ALERTS_NOTE = """\
✓: the source's layer records every series the alert reads; —: it does not, and the alert stays
silent for that source. The composite counts only the dimensions its source has, each read as that
source can (on vLLM: inter-token latency, the KV cache preempting, a stalled model): it fires when two
hold on one device. Loki alerts read the logs `gpuscope serve` ships."""

PANELS_NOTE = """\
✓: the panel shows data from that source; —: it stays empty; any: it reads no source (node_exporter,
the receiver, Prometheus' own series). Loki panels show `gpuscope serve`'s logs."""


#: Where ``render`` is written, relative to the repository root.
OUTPUT = "docs/sources.md"


def outputs() -> dict[str, str]:
    """docs/sources.md of the production profile, for ``gpuscope generate``."""
    return {OUTPUT: render(PRODUCTION)}
