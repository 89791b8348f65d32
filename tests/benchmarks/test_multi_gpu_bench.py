"""benchmarks/multi_gpu_bench.py runs to the end anywhere and says what it could not measure.

On a host without two CUDA devices (CI) the GPU parts must be recorded as skipped with the reason,
not crash; with ``--cpu-stand-in`` the timer and server parts' code runs on CPU stand-ins.
"""

from __future__ import annotations

import importlib.util
from functools import partial
from pathlib import Path

import torch

from tests import conftest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_gpu_bench.py"
TOP_LEVEL = {"gpu", "gpu_count", "date", "torch", "parts", "targets", "summary"}
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
run_bench = partial(conftest.run_bench, SCRIPT)  # (tmp_path, *args, status=0)


def test_quick_run_reports_what_it_could_not_do(tmp_path: Path) -> None:
    proc, report = run_bench(tmp_path)
    assert set(report) >= TOP_LEVEL
    assert set(report["parts"]) == {"exporter", "timer", "server", "serve"}
    assert report["gpu_count"] == GPUS
    assert report["failures"] == []
    assert "written" in proc.stdout and "[multi_gpu_bench" in proc.stderr  # table last, progress on stderr
    parts = report["parts"]
    assert not any("error" in part for part in parts.values()), parts
    exporter = parts["exporter"]
    # The exporter runs without NVML (zero GPUs): its scrape latency is still measured.
    assert "skipped" in exporter or exporter["scrape"]["scrapes"] > 0
    if GPUS < 2:
        for part in (parts["timer"], parts["server"], parts["serve"]):
            assert part["skipped"] == f"needs >= 2 CUDA devices (found {GPUS})"
        if "skipped" not in exporter:
            assert exporter["process_attribution"]["skipped"].startswith("needs >= 2 CUDA devices")
            assert "skipped" in exporter["devices"]  # no nvidia-smi, or no GPU in the exporter
        assert report["summary"]["process_on_both_gpus"] is None
        assert report["summary"]["timer_device_labels_right"] is None
        assert report["summary"]["share_error_points"] == {}


def test_cpu_stand_ins_run_the_timer_and_server_parts(tmp_path: Path) -> None:
    _, report = run_bench(tmp_path, "--cpu-stand-in", "2", "--parts", "timer,server")
    assert set(report["parts"]) == {"timer", "server"}
    timer = report["parts"]["timer"]
    assert timer["device_labels_right"] and timer["counts_right"], timer["ops"]
    assert timer["dropped_total"] == 0
    assert set(timer["ops"]) == {"matmul_dev0", "matmul_dev1", "switch_dev0", "switch_dev1"}
    gpus = report["parts"]["server"]["per_gpu"]
    assert len(gpus) == 2
    for gpu in gpus.values():
        assert gpu["tokens_per_s"] > 0 and gpu["errors"] == 0
        assert set(gpu["shares"]) == {"a", "b"} and gpu["share_error_points"] is not None
    assert set(report["summary"]["share_error_points"]) == set(gpus)
    probe = report["parts"]["server"]["separate_process"]  # a fresh serve-like process
    assert "error" not in probe, probe
    assert probe["tokens_per_s"] > 0 and probe["timed_region_device_labels"]


def test_a_part_that_crashes_fails_the_run_and_is_named(tmp_path: Path) -> None:
    proc, report = run_bench(tmp_path, "--parts", "exporter", "--exporter-arg=--no-such-flag", status=1)
    assert report["failures"] and report["failures"][0].startswith("exporter: ")
    assert "FAILED exporter: " in proc.stderr and "FAILED" in proc.stdout


def load_bench():
    spec = importlib.util.spec_from_file_location("multi_gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_nested_error_or_an_unmeasured_check_is_a_failure() -> None:
    bench = load_bench()
    parts = {"exporter": {"skipped": "no GPU"}, "timer": {"skipped": "no GPU"},
             "server": {"per_gpu": {}, "separate_process": {"error": "RuntimeError: probe exited 1\n..."}},
             "serve": {"steps_timed_on_model_device": None}}
    report = {"parts": parts, "summary": bench.summarise(parts)}
    found = bench.failures(report)
    assert "server.separate_process: RuntimeError: probe exited 1" in found
    assert "serve: check serve_over_http_timed_on_its_device has no value (nothing measured)" in found
    # a skipped part's checks have no value, and that is no failure
    assert not any(f.startswith(("exporter", "timer")) for f in found)
