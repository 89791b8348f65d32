"""The GPU sources as deployed (MIG, pod replacement, both ServiceMonitor modes, both XID formats, the
bundle's exporter with pod attribution): the promtool cases of ``tests/alerts/deployed_gpu_cases.py``,
current and passing in both profiles."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.alerts import deployed_gpu_cases
from tests.alerts.test_rules import UNIT_TESTS
from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rel", sorted(deployed_gpu_cases.outputs()))
def test_the_cases_are_current(rel: str) -> None:
    expected = deployed_gpu_cases.outputs()[rel]
    assert (ROOT / rel).read_text() == expected, "run: python -m tests.alerts.deployed_gpu_cases"


def test_the_production_cases_run_with_every_source_case_file() -> None:
    """test_rules.py runs promtool on every file under tests/alerts/cases/sources/, this one's
    production cases among them; the test-profile copy runs below."""
    assert ROOT / deployed_gpu_cases.PATHS["production"] in UNIT_TESTS


@pytest.mark.distro
def test_promtool_passes_every_case_in_the_test_profile() -> None:
    """promtool also fails on any rule evaluation error, so each case proves its joins hold."""
    path = ROOT / deployed_gpu_cases.PATHS["test"]
    result = subprocess.run([require_binary("promtool"), "test", "rules", path.name], cwd=path.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_case_is_checked_silent_and_firing() -> None:
    """Each case asserts an alert silent and one firing, in both profiles alike."""
    for rel in deployed_gpu_cases.outputs():
        for case in yaml.safe_load((ROOT / rel).read_text())["tests"]:
            checks = case["alert_rule_test"]
            firing = any(c["exp_alerts"] for c in checks)
            assert firing and any(not c["exp_alerts"] for c in checks), case["name"]
