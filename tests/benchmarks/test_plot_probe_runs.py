"""benchmarks/plot_probe_runs.py draws the committed probe results, and refuses what is not one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "plot_probe_runs.py"
RUNS = sorted((ROOT / "benchmarks" / "results").glob("recycle*-h200*.json"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_draws_every_run_of_the_committed_results(tmp_path: Path) -> None:
    assert len(RUNS) >= 2, "the recycler probes' results are committed under benchmarks/results"
    out = tmp_path / "runs.png"
    result = plot(*map(str, RUNS), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_a_file_that_is_not_a_probe_result_gets_one_line_and_status_2(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"workloads": {}}))
    out = tmp_path / "runs.png"
    result = plot(str(RUNS[0]), str(other), "--out", str(out))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "other.json: not a hot_path_probes.py result" in lines[0]
    assert not out.exists()
