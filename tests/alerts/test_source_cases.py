"""Generated cases on other sources' series (vLLM's engines, dcgm-exporter's framebuffer): current, and
their test-profile copies pass promtool (the production ones run with every file under
tests/alerts/cases/sources/ in test_rules.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests.alerts import dcgm_memory_cases, engine_cases
from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[2]
GENERATORS = (engine_cases, dcgm_memory_cases)


@pytest.mark.parametrize("generator", GENERATORS, ids=lambda g: g.__name__.rsplit(".", 1)[-1])
def test_cases_are_current(generator: ModuleType) -> None:
    for rel, text in generator.outputs().items():
        assert (ROOT / rel).read_text() == text, f"run: python -m {generator.__name__}"


@pytest.mark.distro
@pytest.mark.parametrize("generator", GENERATORS, ids=lambda g: g.__name__.rsplit(".", 1)[-1])
def test_cases_pass_in_the_test_profile(generator: ModuleType) -> None:
    path = ROOT / generator.PATHS["test"]
    result = subprocess.run([require_binary("promtool"), "test", "rules", path.name], cwd=path.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
