"""benchmarks/share_sim_bench.py on the fake driver's shared GPU: a short run of one mix in two variants,
the file it writes, and its drawing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "share_sim_bench.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_mix_runs_in_each_variant_and_is_drawn(tmp_path: Path) -> None:
    from gpuscope.share.preload import library_path

    if shutil.which("gcc") is None or library_path() is None:
        pytest.skip("the fake driver needs gcc, and the tenants the preload library")
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "1", "--mixes", "short+hog 25/75",
                           "--variants", "unmanaged,drain-starved", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["alone"]) == {"short", "hog"} and all(v > 0 for v in data["alone"].values())
    (entry,) = data["mixes"]
    assert [sorted(r) for r in entry["rounds"]] == [["drain-starved", "unmanaged"]]
    for variant in ("unmanaged", "drain-starved"):
        tenants = entry[variant]["tenants"]
        assert [(t["workload"], t["share"]) for t in tenants] == [("short", 0.25), ("hog", 0.75)]
        assert all(t["fraction"] > 0 for t in tenants), tenants
    assert "starved" in entry["drain-starved"] and "starved" not in entry["unmanaged"]
    assert entry["sum_unmanaged"] == entry["unmanaged"]["sum"]
    drawn = subprocess.run([sys.executable, str(SCRIPT), "--plot", str(out), "--out", str(png)],
                           capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_an_unknown_variant_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--variants", "drain,fastest", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0
    assert done.stderr.strip() == "share_sim_bench: unknown variant or mix: fastest"
