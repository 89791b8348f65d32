"""benchmarks/graph_timing_bench.py: how CUPTI's kernels are split into passes, and its flags."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "graph_timing_bench.py"


def bench_module():
    sys.path.insert(0, str(SCRIPT.parent))  # its own folder, for benchlib, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location("graph_timing_bench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_kernels_are_split_into_passes_in_time_order() -> None:
    # Two passes of two kernels, reported out of order: pass 1 has a 0.5 µs gap, pass 2 a 0.2 µs one.
    kernels = [(10.0, 11.0), (0.0, 1.0), (11.2, 12.0), (1.5, 2.0)]
    spans = bench_module().pass_spans(kernels, 2)
    assert spans["kernels_per_pass"] == 2
    assert spans["kernel_sum_us"] == pytest.approx((1.5 + 1.8) / 2)
    assert spans["span_us"] == pytest.approx((2.0 + 2.0) / 2)


def test_a_kernel_count_that_does_not_split_into_equal_passes_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="3 kernels for 2 passes"):
        bench_module().pass_spans([(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)], 2)


def test_an_unknown_part_is_a_usage_error() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--parts", "accuracy,nope"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert "--parts: choose from accuracy, throughput, kernels" in result.stderr
