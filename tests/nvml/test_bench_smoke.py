"""The exporter benchmark runs end to end where there is no GPU (zero devices), cheaply."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "exporter.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/exporter_bench.py"), "--scrapes", "20",
         "--scrape-window", "1", "--cpu-window", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    for key in ("gpu", "date", "scrape_p50_ms", "scrape_p99_ms", "nvidia_smi_query_ms", "exporter_cpu_pct"):
        assert key in data, key
    assert data["scrapes"] == 20
    assert 0 < data["scrape_p50_ms"] <= data["scrape_p99_ms"]
    assert data["gpus"] >= 0 and data["series"] > 0
    assert "scrape p50 / p99" in result.stdout.splitlines()[1]  # the table comes last, on stdout
