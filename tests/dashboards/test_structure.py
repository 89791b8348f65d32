"""The generated dashboards as Grafana will load them: layout, panel types, datasources, heatmaps."""

from __future__ import annotations

import re

import pytest
import yaml

from gpuscope import catalogue
from tests.dashboards.panels import ROOT, UIDS, dashboards, panels, queries

MODERN = {"timeseries", "stat", "heatmap", "table", "logs"}
PROVISIONED = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "gpuscope.yml"
#: Series the dashboards may read that are not gpuscope's: Prometheus' own and node_exporter's.
FOREIGN = re.compile(r"^(up|ALERTS|node_\w+|gpuscope:[a-z_:]+)$")


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
        assert re.match(r"^sum by \(le\) \(increase\(\w+_bucket\{.*\}\[\$__rate_interval\]\)\)$",
                        target["expr"]), target["expr"]
        assert target["format"] == "heatmap" and target["legendFormat"] == "{{le}}", p["title"]
        assert "dataFormat" not in p and "yBucketBound" not in p, "legacy heatmap fields"


def test_latency_panels_show_exemplars():
    for q_panel in dashboards()["gpuscope-slo"]["panels"]:
        if q_panel["type"] == "heatmap" or "percentiles" in q_panel["title"]:
            assert all(t["exemplar"] for t in q_panel["targets"]), q_panel["title"]


def test_variables_cover_instance_gpu_op_tenant():
    names = {v["name"] for dash in dashboards().values() for v in dash["templating"]["list"]}
    assert {"instance", "gpu", "op", "tenant"} <= names
    for uid, dash in dashboards().items():
        defined = {v["name"] for v in dash["templating"]["list"]}
        used = {m for p in panels(dash) for t in p.get("targets", [])
                for m in re.findall(r"\$(\w+)", t["expr"]) if not m.startswith("__")}
        assert used <= defined, f"{uid} uses undefined variables {used - defined}"


def test_every_metric_name_comes_from_the_catalogue():
    known = {m.name for m in catalogue.all_metrics()}
    series = known | {m.name + s for m in catalogue.all_metrics() if m.type == "histogram"
                      for s in ("_bucket", "_sum", "_count")}
    for q in queries("prometheus"):
        stripped = re.sub(r'"[^"]*"', '""', q.expr)  # label values are not metric names
        for name in re.findall(r"\b[A-Za-z_:][\w:]*(?=\s*\{)", stripped):
            assert name in series or FOREIGN.match(name), f"{q.dashboard}/{q.panel}: unknown series {name}"
