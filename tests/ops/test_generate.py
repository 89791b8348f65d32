"""`gpuscope generate`: one command writes every generated file; `--check` fails on drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from gpuscope.ops import generate

ROOT = Path(__file__).resolve().parents[2]


def test_every_committed_generated_file_is_current():
    stale, orphans = generate.run(ROOT, check=True)
    assert (stale, orphans) == ([], []), "run `gpuscope generate` and commit the result"


def checkout_copy(tmp_path: Path) -> Path:
    """The parts of the checkout the generators read and write."""
    root = tmp_path / "repo"
    (root / "src" / "gpuscope").mkdir(parents=True)
    for folder in ("alerts", "dashboards/json", "docs", "deploy"):
        shutil.copytree(ROOT / folder, root / folder)
    for name in ("pyproject.toml", "docker-compose.yml", "docker-compose.gpu.yml"):
        shutil.copy(ROOT / name, root / name)
    return root


def gpuscope(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuscope", "generate", *args], capture_output=True,
                          text=True, timeout=240)


def test_check_names_a_tampered_file_and_an_orphan_and_writing_mends_both(tmp_path):
    root = checkout_copy(tmp_path)
    victim = root / "dashboards" / "json" / "gpuscope-logs.json"
    victim.write_text(victim.read_text().replace('"gpuscope-logs"', '"tampered"', 1))
    (root / "dashboards" / "json" / "left-over.json").write_text("{}\n")
    (root / "docs" / "alerts.md").unlink()
    checked = gpuscope("--check", "--root", str(root))
    assert checked.returncode == 1
    for name in ("dashboards/json/gpuscope-logs.json", "docs/alerts.md",
                 "orphan: dashboards/json/left-over.json"):
        assert name in checked.stderr, checked.stderr
    assert "tampered" in victim.read_text()  # --check writes nothing
    written = gpuscope("--root", str(root))
    assert written.returncode == 0, written.stderr
    assert gpuscope("--check", "--root", str(root)).returncode == 0
    assert victim.read_text() == (ROOT / "dashboards" / "json" / "gpuscope-logs.json").read_text()
    assert not (root / "dashboards" / "json" / "left-over.json").exists()


def test_a_root_that_is_not_a_checkout_is_one_line_and_status_2(tmp_path):
    result = gpuscope("--check", "--root", str(tmp_path))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith("is not a gpuscope checkout (no src/gpuscope/ there)")
