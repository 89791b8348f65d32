"""benchmarks/share_controller_split.py on the fake GPU: a short round of two tenants taking turns, its
controller's CPU split into parts that fit inside the whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "share_controller_split.py"


def test_a_round_splits_the_controllers_cpu_into_parts_within_it(tmp_path: Path) -> None:
    from gpuscope.share.preload import library_path

    if shutil.which("gcc") is None or library_path() is None:
        pytest.skip("the fake driver needs gcc, and the tenants the preload library")
    out = tmp_path / "split.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--seconds", "2", "--scrapes", "3",
                           "--scenarios", "turns", "--port", "9431", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["scenario"] == "turns"
    # the two tenants take turns: the loop steps and the keeper hands over, and both took CPU
    assert row["steps_per_s"] > 0 and row["keeper_calls_per_s"] > 0, row
    assert row["step_cpu_pct"] > 0 and row["keeper_cpu_pct"] > 0, row
    # the keeper returns at least at its deadline (every 500 ms), and each return is counted once
    assert sum(row["keeper_returns_per_s"].values()) == pytest.approx(row["keeper_calls_per_s"], abs=0.6)
    # the parts are measured on the threads' clocks, the whole on the process's: they fit inside it
    parts = row["step_cpu_pct"] + row["keeper_cpu_pct"]
    assert parts <= row["controller_cpu_pct"] * 1.05 + 0.01, row
    assert sum(t["cpu_pct"] for t in row["threads"].values()) <= row["controller_cpu_pct"] * 1.05 + 0.01, row
    assert row["scrape_cpu_ms"] > 0


def test_an_unknown_scenario_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--scenarios", "turns,nope", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("--scenarios: 'nope' not one of turns, beside, lend, graph, graph-turns, "
                         "graph-gaps, graph-spread, encoder, all-beside"), last
