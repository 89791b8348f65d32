"""benchmarks/timer_cpu_bench.py: one short round over this tree, every path, and its flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "timer_cpu_bench.py"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                    reason="the fake CUDA runtime is compiled from C")
def test_one_round_reports_every_path_per_region(tmp_path: Path) -> None:
    from gpuscope.timing import hot

    out = tmp_path / "report.json"
    result = bench("--rounds", "1", "--regions", "400", "--block", "200", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    paths = report["trees"][str(ROOT)]
    expected = {"python", "c-python-loop", "c-loop", "c-recycler"} if hot.native_available() else {"python"}
    assert set(paths) == expected
    for figures in paths.values():
        assert figures["hot_ns"] > 0 and figures["resolve_ns"] > 0
        assert figures["total_ns"] >= figures["hot_ns"] + figures["resolve_ns"] - 0.2  # rounded to 0.1
    assert set(report["python_over_c"][str(ROOT)]) == expected - {"python"}


def test_an_unknown_path_is_a_usage_error() -> None:
    result = bench("--paths", "python,nope")
    assert result.returncode == 2
    assert "--paths: unknown nope; choose from python, c-python-loop, c-loop, c-recycler" in result.stderr


def test_a_folder_that_is_not_a_source_tree_is_a_usage_error(tmp_path: Path) -> None:
    result = bench("--tree", str(tmp_path))
    assert result.returncode == 2
    assert "not a gpuscope source tree" in result.stderr
