"""The generated target-missing cases are current, and check what they claim (promtool runs them with
every other file under tests/alerts/cases/ in test_rules.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.alerts import target_cases

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rel", sorted(target_cases.outputs()))
def test_target_cases_are_current(rel: str) -> None:
    assert (ROOT / rel).read_text() == target_cases.outputs()[rel], "run: python -m tests.alerts.target_cases"


def test_healthy_start_asserts_no_pending_state_through_the_first_minutes() -> None:
    doc = yaml.safe_load((ROOT / "tests/alerts/cases/targets.test.yml").read_text())
    start = next(case for case in doc["tests"] if case["name"] == "healthy_start")
    checks = start["promql_expr_test"]
    assert all(c["expr"].startswith("ALERTS{") and c["exp_samples"] == [] for c in checks)
    minutes = sorted(float(c["eval_time"].removesuffix("s")) / 60 for c in checks)
    assert minutes[0] <= 0.5 and minutes[-1] >= 5  # from the first scrape to well past the 2m for


def test_the_desired_count_selectors_pick_the_kube_state_metrics_series_of_the_cases() -> None:
    """The rules' selectors name kube-state-metrics' series and labels as the cases write them."""
    from gpuscope.contract.profiles import PRODUCTION

    for selector, series in ((PRODUCTION.selectors.server_desired, target_cases.DEPLOYMENT),
                             (PRODUCTION.selectors.exporter_desired, target_cases.DAEMONSET)):
        name, matchers = selector.rstrip("}").split("{")
        assert series.startswith(name + "{")
        assert all(m in series for m in matchers.split(","))
