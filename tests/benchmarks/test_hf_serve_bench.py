"""benchmarks/hf_serve_bench.py runs end to end on CPU (``--quick``) and names a part that fails.

The GPU run (TinyLlama-shaped, 1/8/32 streams) is for an H200; here the tiny size checks the code
paths: the model and tokenizer it builds offline, `gpuscope serve --model.hf` as child processes, the
streaming client, and the report.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from tests import conftest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_serve_bench.py"
run_bench = partial(conftest.run_bench, SCRIPT, timeout=280)  # (tmp_path, *args, status=0)


def test_quick_run_measures_every_part(tmp_path: Path) -> None:
    proc, report = run_bench(tmp_path)
    assert report["failures"] == []
    assert set(report["parts"]) == {"model", "concurrency", "timing"}
    assert "written" in proc.stdout.splitlines()[-1] and "[hf_serve_bench" in proc.stderr
    model = report["parts"]["model"]
    assert model["shape"]["vocab_size"] == 32000 and model["parameters"] > 0
    levels = report["parts"]["concurrency"]["levels"]
    assert set(levels) == {"1", "4"}
    for streams, level in levels.items():
        assert level["errors"] == 0 and level["requests"] == int(streams) * 2
        assert level["completion_tokens"] > 0 and level["tokens_per_s"] > 0
        assert level["ttft_p99_ms"] >= level["ttft_p50_ms"] > 0
    assert levels["4"]["mean_decode_batch_rows"] > 1  # four streams share decode steps
    timing = report["parts"]["timing"]
    assert len(timing["rounds"]) == 2 and all(set(r) == {"off", "budget", "all"} for r in timing["rounds"])
    modes = timing["modes"]
    assert not modes["off"]["per_module_regions"]
    for mode in ("budget", "all"):
        assert modes[mode]["per_module_regions"] and modes[mode]["ratio_to_off"]["median"] > 0
        assert "model.layers.0.mlp" in modes[mode]["module_ops"]


def test_a_part_that_fails_fails_the_run_and_is_named(tmp_path: Path) -> None:
    proc, report = run_bench(tmp_path, "--parts", "concurrency", "--server-arg=--no-such-flag", status=1)
    assert report["failures"] and report["failures"][0].startswith("concurrency: ")
    assert "FAILED concurrency: " in proc.stderr and "FAILED" in proc.stdout
    assert "timing" not in report["parts"]
