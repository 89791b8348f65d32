"""The generated dashboards as Grafana will load them: layout, panel types, datasources, heatmaps."""

from __future__ import annotations

import re

import pytest
import yaml

from gpuscope.alerting import generate, sources
from gpuscope.contract import catalogue, names
from gpuscope.contract.profiles import PRODUCTION
from tests.dashboards.panels import ROOT, UIDS, dashboards, panels, queries

MODERN = {"timeseries", "stat", "heatmap", "table", "logs"}
PROVISIONED = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "gpuscope.yml"
#: Series the dashboards may read that no source records: Prometheus' own, node_exporter's (the host,
#: whatever the sources) and the bundle's own alert receiver's.
FOREIGN = re.compile(rf"^(up|ALERTS|node_\w+|{catalogue.RECEIVER_NOTIFICATIONS.name})$")
#: Every normalised and derived series (names.py).
NAMED = {v for k, v in vars(names).items()
         if k.isupper() and isinstance(v, str) and v.startswith("gpuscope:")}


def provisioned_uids() -> dict[str, str]:
    config = yaml.safe_load(PROVISIONED.read_text())
    return {ds["uid"]: ds["type"] for ds in config["datasources"]}


def test_exactly_the_six_dashboards():
    found = sorted(p.stem for p in (ROOT / "dashboards" / "json").glob("*.json"))
    assert found == sorted(UIDS)
    for uid, dash in dashboards().items():
        assert dash["uid"] == uid


@pytest.mark.parametrize("uid", UIDS)
def test_panel_ids_unique_and_grid_without_overlap(uid):
    dash = dashboards()[uid]
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {uid}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels(dash):
        pos = p["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["y"] >= 0, p["title"]
        assert pos["x"] + pos["w"] <= 24, f"{p['title']} runs past 24 columns"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]} in {uid}"
                cells[(x, y)] = p["title"]


def _walk(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", key, value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


@pytest.mark.parametrize("uid", UIDS)
def test_modern_panels_only_and_no_null_options(uid):
    dash = dashboards()[uid]
    for p in panels(dash):
        assert p["type"] in MODERN, f"{p['title']}: {p['type']} is not a modern panel type"
    nulls = [path for path, key, value in _walk(dash) if key == "options" and value is None]
    assert not nulls, f"options: null at {nulls}"


def test_datasources_match_provisioning():
    uids = provisioned_uids()
    assert uids == {"gpuscope-prometheus": "prometheus", "gpuscope-loki": "loki",
                    "gpuscope-alertmanager": "alertmanager"}
    for uid, dash in dashboards().items():
        for p in panels(dash):
            refs = [p["datasource"], *(t["datasource"] for t in p.get("targets", []))]
            for ref in refs:
                assert uids.get(ref["uid"]) == ref["type"], f"{uid}/{p['title']}: {ref}"
        for var in dash["templating"]["list"]:
            assert uids.get(var["datasource"]["uid"]) == var["datasource"]["type"]


def test_exemplar_links_open_the_trace_in_tempo_and_the_logs_in_loki():
    provisioned = yaml.safe_load(PROVISIONED.read_text())["datasources"]
    prometheus = next(ds for ds in provisioned if ds["type"] == "prometheus")
    tempo, logs = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    # trace_id: the exemplar label the server and timer attach
    assert tempo == {"name": "trace_id", "datasourceUid": "gpuscope-tempo",
                     "urlDisplayLabel": "Trace in Tempo"}
    assert logs["name"] == "trace_id"
    assert "gpuscope-loki" in logs["url"] and "$${__value.raw}" in logs["url"]
    loki = next(ds for ds in provisioned if ds["type"] == "loki")
    (derived,) = loki["jsonData"]["derivedFields"]
    assert derived["datasourceUid"] == "gpuscope-tempo"
    line = '{"msg": "request", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "tenant": "alpha"}'
    assert re.search(derived["matcherRegex"], line).group(1) == "4bf92f3577b34da6a3ce929d0e0e4736"
    tempo_file = yaml.safe_load((PROVISIONED.parent / "tempo.yml").read_text())
    assert [ds["uid"] for ds in tempo_file["datasources"]] == ["gpuscope-tempo"]


def test_heatmaps_read_buckets_in_heatmap_format():
    heatmaps = [p for dash in dashboards().values() for p in panels(dash) if p["type"] == "heatmap"]
    assert len(heatmaps) >= 7
    for p in heatmaps:
        (target,) = p["targets"]
        if p["options"]["calculate"]:
            # Grafana buckets raw gauge values itself (utilization across GPUs): no _bucket series exist.
            assert "_bucket" not in target["expr"] and target["format"] == "time_series", p["title"]
            continue
        # The normalised bucket rates (recorded over the latency window): no rate() of their own.
        assert re.match(r"^sum by \(le\) \(gpuscope:\w+_bucket:rate\{.*\}\)$", target["expr"]), target["expr"]
        assert target["format"] == "heatmap" and target["legendFormat"] == "{{le}}", p["title"]
        assert "dataFormat" not in p and "yBucketBound" not in p, "legacy heatmap fields"


def test_no_panel_asks_recorded_series_for_exemplars():
    """Recording rules carry no exemplars (docs/sources.md): a switch on would show nothing."""
    for dash in dashboards().values():
        for p in panels(dash):
            assert not any(t.get("exemplar") for t in p.get("targets", [])), p["title"]


def test_variables_cover_instance_gpu_op_tenant():
    names = {v["name"] for dash in dashboards().values() for v in dash["templating"]["list"]}
    assert {"instance", "gpu", "op", "tenant"} <= names
    for uid, dash in dashboards().items():
        defined = {v["name"] for v in dash["templating"]["list"]}
        used = {m for p in panels(dash) for t in p.get("targets", [])
                for m in re.findall(r"\$(\w+)", t["expr"]) if not m.startswith("__")}
        assert used <= defined, f"{uid} uses undefined variables {used - defined}"


def _read(expr: str) -> set[str]:
    """Every series name in a query: selectors and bare names (functions and keywords left out)."""
    stripped = re.sub(r'"[^"]*"', '""', expr)
    words = set(re.findall(r"(?<![\w:$])[A-Za-z_:][\w:]*", stripped))
    functions = set(re.findall(r"(?<![\w:])([A-Za-z_]+)\s*\(", stripped))
    keywords = {"sum", "by", "max", "min", "avg", "count", "without", "on", "ignoring", "group_left",
                "group_right", "bool", "and", "or", "unless", "vector", "le", "offset"}
    labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!=|!~|=)", stripped))
    clauses = re.findall(r"(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", stripped)
    grouped = {w for clause in clauses for w in re.findall(r"\w+", clause)}
    return words - functions - keywords - labels - grouped


def test_every_panel_reads_only_normalised_series():
    """No panel names a source's metric: each reads names.py's series, or node_exporter's, up, ALERTS."""
    for q in queries("prometheus"):
        for name in _read(q.expr):
            assert name in NAMED or FOREIGN.match(name), f"{q.dashboard}/{q.panel}: reads {name} ({q.expr})"
    for dash in dashboards().values():
        for var in dash["templating"]["list"]:
            (selector,) = re.findall(r"label_values\((\w[\w:]*)", var["query"])
            assert selector in NAMED or FOREIGN.match(selector), var["query"]


def test_every_series_a_panel_reads_is_recorded():
    """By some source's layer or by the derived rules: a panel never reads a name no rule writes."""
    recorded = {r.record for src in sources.SOURCES.values() for r in sources.records(src, PRODUCTION)}
    recorded |= {r.record for g in generate.consumer_groups(PRODUCTION) for r in g.rules
                 if hasattr(r, "record")}
    for q in queries("prometheus"):
        for name in _read(q.expr) & NAMED:
            assert name in recorded, f"{q.dashboard}/{q.panel}: {name} is recorded by no rule"
