"""The committed dashboard JSON and datasource file are exactly what the grafanalib sources generate."""

from __future__ import annotations

import runpy
import subprocess
import sys

from tests.dashboards.panels import ROOT

GENERATOR = ROOT / "dashboards" / "generate.py"


def test_committed_files_match_a_fresh_generation():
    outputs = runpy.run_path(str(GENERATOR))["outputs"]()
    stale = [str(path.relative_to(ROOT)) for path, text in outputs.items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"stale generated files {stale}: run python dashboards/generate.py and commit"


def test_check_mode_fails_on_a_stale_file(tmp_path):
    # The --check switch CI users run must notice drift, not just pass.
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    victim = ROOT / "dashboards" / "json" / "gpuscope-logs.json"
    original = victim.read_text()
    try:
        victim.write_text(original.replace('"gpuscope-logs"', '"tampered"', 1))
        result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 1
        assert "gpuscope-logs.json" in result.stderr
    finally:
        victim.write_text(original)
