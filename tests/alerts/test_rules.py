"""Generated rule files: current, valid, tested by promtool per area, and complete (labels, links, docs)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from gpuscope.alerting import composite, generate, slo, sources
from gpuscope.alerting.rules import DASHBOARDS
from gpuscope.contract import names
from gpuscope.contract.profiles import (
    PRODUCTION,
    PROFILES,
    TEST,
    TEST_COMPRESSION,
    TEST_MIN_WINDOW_S,
    Thresholds,
)
from tests.alerts import leak_envelope, memory_shapes
from tests.conftest import require_binary, selected, side_by_side

ROOT = Path(__file__).resolve().parents[2]
#: Production cases (the default sources', and each other source's under sources/), and test-profile
#: copies of some of them (the same series, time compressed 15×).
UNIT_TESTS = sorted([*(ROOT / "tests/alerts/cases").glob("*.test.yml"),
                     *(ROOT / "tests/alerts/cases/sources").glob("*.test.yml")])
TEST_PROFILE_CASES = sorted((ROOT / "tests/alerts/cases/test-profile").glob("*.test.yml"))
#: Alerts whose cases run in both profiles: each is asserted silent and firing in the test profile too.
BOTH_PROFILES = {"GPUMemoryLeak", "GPUMemoryRunningOut", "GPUFramebufferFillingUp",
                 "GPUFramebufferRunningOut", "GPUServiceDegraded", "GPUServerTargetMissing",
                 "GPUExporterTargetMissing", "GPUExporterGPUsMissing"}
RULE_FILES = [path for p in PROFILES.values() for path in (
    generate.prometheus_rules_path(p), generate.sources_rules_path(p),
    *(generate.source_rules_path(p, name) for name in sources.SOURCES))]
DURATION = re.compile(r"\b\d+[smhd]\b")


def _rules(path: str) -> list[dict]:
    return [r for g in yaml.safe_load((ROOT / path).read_text())["groups"] for r in g["rules"]]


@pytest.mark.parametrize("rel", sorted(generate.outputs()))
def test_generated_file_is_current(rel: str) -> None:
    assert (ROOT / rel).read_text() == generate.outputs()[rel], "run: gpuscope generate"


def test_generate_check_reports_stale_alerting_files(tmp_path: Path) -> None:
    (tmp_path / "src" / "gpuscope").mkdir(parents=True)  # a checkout's shape, without its files
    cmd = [sys.executable, "-m", "gpuscope", "generate", "--only", "alerting", "--root", str(tmp_path)]
    stale = subprocess.run([*cmd, "--check"], capture_output=True, text=True, timeout=60)
    assert stale.returncode == 1 and "alerts/alertmanager.yml" in stale.stderr
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    assert subprocess.run([*cmd, "--check"], capture_output=True, timeout=60).returncode == 0


@pytest.mark.distro
@pytest.mark.parametrize("rel", RULE_FILES)
def test_promtool_check_rules(rel: str) -> None:
    result = subprocess.run([require_binary("promtool"), "check", "rules", str(ROOT / rel)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _promtool_test(path: Path) -> tuple[int | None, str]:
    try:
        result = subprocess.run([require_binary("promtool"), "test", "rules", path.name], cwd=path.parent,
                                capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, "promtool test rules: no answer in 300 s"
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="module")
def unit_test_runs(request: pytest.FixtureRequest) -> dict[Path, tuple[int | None, str]]:
    """promtool's exit status and output for every selected unit-test file, largest first."""
    require_binary("promtool")
    paths = sorted(selected(request, "test_promtool_unit_tests", "path"), key=lambda p: -p.stat().st_size)
    return side_by_side(_promtool_test, paths)  # promtool is single-threaded; the biggest files dominate


@pytest.mark.distro
@pytest.mark.timeout(900)  # the first one waits for every promtool run, beside other tests under `pytest -n`
@pytest.mark.parametrize("path", UNIT_TESTS + TEST_PROFILE_CASES,
                         ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_promtool_unit_tests(path: Path, unit_test_runs) -> None:
    status, output = unit_test_runs[path]
    assert status == 0, output


@pytest.mark.parametrize("rel", sorted(memory_shapes.outputs()))
def test_memory_shape_cases_are_current(rel: str) -> None:
    expected = memory_shapes.outputs()[rel]
    assert (ROOT / rel).read_text() == expected, "run: python -m tests.alerts.memory_shapes"


def _tested(paths: list[Path]) -> tuple[set[str], set[str]]:
    firing, silent = set(), set()
    for path in paths:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    return firing, silent


def test_every_prometheus_alert_is_tested_silent_and_firing() -> None:
    firing, silent = _tested(UNIT_TESTS)
    alerts = {r["alert"] for r in _rules(generate.prometheus_rules_path(PRODUCTION)) if "alert" in r}
    assert alerts - firing == set(), "never asserted firing"
    assert alerts - silent == set(), "never asserted silent"
    firing, silent = _tested(TEST_PROFILE_CASES)
    assert BOTH_PROFILES - firing == set(), "never asserted firing in the test profile"
    assert BOTH_PROFILES - silent == set(), "never asserted silent in the test profile"


def _seconds(text: str) -> float:
    return sum(float(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
               for n, unit in re.findall(r"([\d.]+)([smhd])", text))


def _checks(group: dict, scale: int) -> list[tuple]:
    alerts = [(c["alertname"], _seconds(c["eval_time"]) * scale,
               sorted(sorted(a["exp_labels"].items()) for a in c.get("exp_alerts") or []))
              for c in group.get("alert_rule_test", [])]
    exprs = [(c["expr"], _seconds(c["eval_time"]) * scale, c.get("exp_samples"))
             for c in group.get("promql_expr_test", [])]
    return sorted(alerts, key=repr) + sorted(exprs, key=repr)


@pytest.mark.parametrize("path", TEST_PROFILE_CASES, ids=lambda p: p.name)
def test_test_profile_cases_are_production_cases_compressed(path: Path) -> None:
    """Same series and values, same checks and labels at times ÷ 15, against the test rules."""
    production = yaml.safe_load((ROOT / "tests/alerts/cases" / path.name).read_text())
    doc = yaml.safe_load(path.read_text())
    assert doc["rule_files"] == [f"../../../../{path}" for path in
                                 (generate.sources_rules_path(TEST), generate.prometheus_rules_path(TEST))]
    assert doc["group_eval_order"] == generate.group_order(TEST)
    assert _seconds(doc["evaluation_interval"]) == TEST.evaluation_interval
    for group in doc["tests"]:
        same = [g for g in production["tests"] if g["input_series"] == group["input_series"]]
        assert len(same) == 1, f"{path.name}: no production case with these series"
        assert _seconds(same[0]["interval"]) == TEST_COMPRESSION * _seconds(group["interval"])
        assert _checks(group, TEST_COMPRESSION) == _checks(same[0], 1)


@pytest.mark.parametrize("profile", PROFILES.values(), ids=lambda p: p.name)
def test_every_alert_has_severity_service_and_links(profile) -> None:
    runbook_anchors = {h.strip().lower() for h in
                       re.findall(r"^## (\w+)\s*$", (ROOT / "docs/runbooks.md").read_text(), re.M)}
    for alert in generate.all_alerts(profile):
        rendered = alert.render(profile)
        assert rendered["labels"]["severity"] in ("critical", "warning")
        assert rendered["labels"]["service"]
        ann = rendered["annotations"]
        assert ann["summary"] and ann["description"]
        base, anchor = ann["runbook_url"].split("#")
        assert base == profile.links.runbook_base and anchor in runbook_anchors, alert.name
        dashboards = "|".join(DASHBOARDS)
        assert re.fullmatch(rf"{profile.links.grafana}/d/({dashboards})(\?.*)?", ann["dashboard_url"])


def test_runbooks_have_one_section_per_alert_and_no_orphans() -> None:
    headings = re.findall(r"^## (\w+)\s*$", (ROOT / "docs/runbooks.md").read_text(), re.M)
    assert sorted(headings) == sorted({a.name for a in generate.all_alerts(PRODUCTION)})
    text = (ROOT / "docs/runbooks.md").read_text()
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        for part in ("Meaning", "First checks", "Fixes"):
            assert f"**{part}**" in section, (section.splitlines()[0], part)


def test_recording_rule_names_are_exported_constants() -> None:
    files = [generate.prometheus_rules_path(PRODUCTION),
             *(generate.source_rules_path(PRODUCTION, name) for name in sources.SOURCES)]
    recorded = {r["record"] for path in files for r in _rules(path) if "record" in r}
    exported = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
    # the custom metrics API's names are prometheus-adapter's, not rules
    assert recorded == exported - {"", *names.QUANTILE_SUFFIXES, names.POD_GPU_BUSY}


def test_test_profile_is_production_with_compressed_windows() -> None:
    """Same rules, labels, thresholds and annotations; only durations differ, and only downwards."""
    def norm(text: str, profile) -> str:
        # Durations, and windows written as plain seconds (e.g. the XID age), become "D".
        # Either profile's: a compressed window can equal a constant of the rules (48 s, XID 48).
        seconds = {str(v) for p in (PRODUCTION, TEST) for v in vars(p.windows).values()}
        text = DURATION.sub("D", text)
        number = r"(?<![.\d])\b\d+\b(?![.\d])"  # whole numbers, not the digits of 0.5
        return re.sub(number, lambda m: "D" if m.group() in seconds else m.group(), text)

    def everything(p) -> list[dict]:
        paths = (generate.prometheus_rules_path(p), generate.sources_rules_path(p),
                 *(generate.source_rules_path(p, n) for n in sources.SOURCES))
        return [r for path in paths for r in _rules(path)]

    prod, test = everything(PRODUCTION), everything(TEST)
    assert len(prod) == len(test)
    for a, b in zip(prod, test, strict=True):
        assert (a.get("record"), a.get("alert")) == (b.get("record"), b.get("alert"))
        for key in ("labels", "annotations"):
            for k in a.get(key) or {}:
                assert norm(a[key][k], PRODUCTION) == norm(b[key][k], TEST), (a.get("alert"), k)
        assert norm(a["expr"], PRODUCTION) == norm(b["expr"], TEST), a.get("alert") or a.get("record")
    for f in fields(TEST.windows):
        floor = f.metadata.get("test_min_s", TEST_MIN_WINDOW_S)
        compressed = getattr(PRODUCTION.windows, f.name) // TEST_COMPRESSION
        assert getattr(TEST.windows, f.name) == max(floor, compressed)
    assert TEST.thresholds == PRODUCTION.thresholds


@pytest.mark.parametrize("profile", PROFILES.values(), ids=lambda p: p.name)
def test_group_wait_lets_the_composite_arrive_first(profile) -> None:
    assert profile.notify.group_wait >= 2 * profile.evaluation_interval


def test_test_profile_detects_each_fault_within_a_few_minutes() -> None:
    """Worst case from fault start to firing: window to fill + for (+ one evaluation)."""
    w, ev = TEST.windows, TEST.evaluation_interval
    assert w.latency + w.latency_for + ev <= 120
    assert w.starvation + w.starvation_for + ev <= 120
    assert w.slo_short_fast + w.slo_page_for + ev <= 120
    assert w.leak + w.leak_for + ev <= 360  # the floor must grow over the whole evidence span first


@pytest.mark.parametrize("profile", PROFILES.values(), ids=lambda p: p.name)
def test_fast_leak_alert_fires_before_the_exhaustion_it_is_for(profile) -> None:
    w = profile.windows
    detection = w.leak_fast_floor + w.leak_fast_step + w.leak_fast_for + profile.evaluation_interval
    assert detection < w.leak_fast_horizon
    assert w.leak_floor < w.leak_step < w.leak - w.leak_floor  # several intervals, each longer than the floor


@pytest.mark.parametrize("profile", PROFILES.values(), ids=lambda p: p.name)
def test_composite_waits_as_long_as_its_components(profile) -> None:
    """A page may not rest on less persistence than the tickets it replaces (see composite.py)."""
    degraded = next(a for a in generate.all_alerts(profile) if a.name == composite.COMPOSITE)
    assert degraded.for_s == max(a.for_s for a in composite.component_alerts(profile))
    names_of_components = {a.name for a in composite.component_alerts(profile)}
    assert names_of_components == {n for group in composite.COMPONENTS.values() for n in group}


def test_slo_objective_must_be_a_ttft_bucket() -> None:
    bad = replace(PRODUCTION, thresholds=replace(Thresholds(), slo_ttft_objective_s=0.9))
    with pytest.raises(ValueError, match="not a bucket"):
        slo.ttft_objective_bucket(bad)


@pytest.mark.parametrize("profile", PROFILES.values(), ids=lambda p: p.name)
def test_loki_rules_use_only_the_server_stream_labels(profile) -> None:
    doc = yaml.safe_load((ROOT / generate.loki_rules_path(profile)).read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == {"GPUServerCUDAOutOfMemory", "GPUServerErrorLogBurst"}
    for rule in rules:
        selectors = re.findall(r"\{([^}]*)\}", rule["expr"])
        assert selectors == [profile.selectors.server_logs], rule["expr"]
        assert "sum by (service, instance)" in rule["expr"]


@pytest.fixture(scope="module")
def covered_pages(request: pytest.FixtureRequest) -> dict[str, float | None]:
    """The first page of every selected covered leak (leak_envelope runs promtool side by side)."""
    require_binary("promtool")
    leaks = selected(request, "test_covered_linear_leaks_page_five_minutes_before_exhaustion", "leak")
    return leak_envelope.first_pages(leaks)


@pytest.mark.timeout(900)  # the first one waits for every promtool run, beside other tests under `pytest -n`
@pytest.mark.parametrize("leak", leak_envelope.COVERED, ids=lambda leak: leak.name)
def test_covered_linear_leaks_page_five_minutes_before_exhaustion(leak, covered_pages) -> None:
    """The production rules under promtool: each leak of the envelope pages with the lead to spare
    (the whole grid, covered or not, is the table ``python -m tests.alerts.leak_envelope`` prints)."""
    paged = covered_pages[leak.name]
    assert paged is not None, f"{leak.name} never paged before exhaustion"
    assert leak.exhausted_at - paged >= leak_envelope.LEAD_MIN, f"{leak.name} paged at {paged}m"
