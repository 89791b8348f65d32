"""benchmarks/diagnose_energy_bench.py runs end to end on CPU (``--quick``) and names a part that fails.

On a GPU host it induces three problems and measures J/token; here the tiny model checks the code
paths: the server, the induced CPU-bound and batch-1 loads, `gpuscope diagnose` as a child with its
transcript and JSON, and the energy part failing by name where NVML is missing.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from tests import conftest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnose_energy_bench.py"
run_bench = partial(conftest.run_bench, SCRIPT, timeout=280)


def _nvml_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: the CPU hosts this smoke run is for
        return False
    return True


def test_quick_run_diagnoses_each_induced_load_and_writes_transcripts(tmp_path: Path) -> None:
    if _nvml_present():
        pytest.skip("a GPU host: the energy part would succeed (run the full benchmark there)")
    _, report = run_bench(tmp_path, status=1)  # the energy part needs NVML
    assert report["failures"] == ["energy"] and "NVML" in report["parts"]["energy"]["error"]
    cases = report["parts"]["diagnose"]
    assert set(cases) - {"wall_s"} == {"cpu_bound", "launch_bound"}  # no GPU memory to fill on CPU
    for name, case in cases.items():
        if name == "wall_s":
            continue
        assert case["exit_status"] in (0, 1) and case["summary"]["source"] == "live"
        assert "verdict:" in case["transcript"]
        assert (tmp_path / f"{SCRIPT.stem}-{name}.txt").read_text().startswith("$ gpuscope diagnose")
    assert cases["launch_bound"]["load_tokens"] > 0
    assert cases["launch_bound"]["summary"]["server"]["tokens_per_s"] > 0
