import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuscope.contract import catalogue
from tests.conftest import promtool_check_metrics

ROOT = Path(__file__).resolve().parents[2]
UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_total", "_joules", "_hertz", "_celsius", "_watts",
                 "_info", "_bytes_per_second")


def test_docs_metrics_md_is_current():
    committed = (ROOT / "docs" / "metrics.md").read_text()
    assert committed == catalogue.render_markdown(), "run: gpuscope generate"


@pytest.mark.parametrize("metric", list(catalogue.all_metrics()), ids=lambda m: m.name)
def test_names_follow_the_rules(metric):
    assert re.fullmatch(r"gpuscope_[a-z0-9_]+", metric.name)
    assert (metric.type == "counter") == metric.name.endswith("_total")
    if metric.unit in ("seconds", "bytes", "ratio", "joules", "hertz", "celsius", "watts"):
        assert any(metric.name.removesuffix("_total").endswith(s) for s in UNIT_SUFFIXES), metric.name
    assert "pid" not in metric.labels or metric.area.startswith("GPU"), "pids only in opt-in attribution"
    if metric.type == "histogram":
        assert list(metric.buckets) == sorted(metric.buckets)


def test_region_buckets_span_one_microsecond_to_ten_seconds():
    assert catalogue.REGION_SECONDS_BUCKETS[0] == 1e-6
    assert catalogue.REGION_SECONDS_BUCKETS[-1] == 10.0


def test_every_metric_builds_and_exposes_under_its_catalogue_name():
    registry = CollectorRegistry()
    for metric in catalogue.all_metrics():
        obj = metric.create(registry)
        if metric.labels:
            obj = obj.labels(*["x"] * len(metric.labels))
        if metric.type == "info":
            obj.info({"k": "v"})
        elif metric.type == "histogram":
            obj.observe(0.5)
        elif metric.type == "counter":
            obj.inc()
        else:
            obj.set(1)
    text = generate_latest(registry).decode()
    for metric in catalogue.all_metrics():
        exposed = re.search(rf"^{metric.name}(_bucket|_count)?{{", text, re.M) or metric.name + " " in text
        assert exposed, metric.name
    promtool_check_metrics(text)


def test_unknown_metric_name_is_a_key_error():
    with pytest.raises(KeyError):
        catalogue.get("gpuscope_no_such_metric")
