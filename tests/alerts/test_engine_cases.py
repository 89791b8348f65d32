"""The vLLM engine cases are current, and the test-profile copy passes promtool (the production one runs
with every file under alerts/tests/sources/ in test_rules.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.alerts import engine_cases
from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rel", sorted(engine_cases.outputs()))
def test_engine_cases_are_current(rel: str) -> None:
    assert (ROOT / rel).read_text() == engine_cases.outputs()[rel], "run: python -m tests.alerts.engine_cases"


@pytest.mark.distro
def test_engine_cases_pass_in_the_test_profile() -> None:
    path = ROOT / engine_cases.PATHS["test"]
    result = subprocess.run([require_binary("promtool"), "test", "rules", path.name], cwd=path.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
