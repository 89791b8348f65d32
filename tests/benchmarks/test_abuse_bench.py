"""benchmarks/abuse_bench.py runs end to end on CPU (``--quick``) and finds the server holding up.

The quick run lowers the connection cap and the body deadline through their environment variables,
so eviction and the 408 happen within the smoke run; what it asserts does not depend on speed.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from tests import conftest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "abuse_bench.py"
run_bench = partial(conftest.run_bench, SCRIPT, timeout=400)


def test_quick_abuse_run_finds_bounded_descriptors_deadlines_a_clean_shutdown_and_no_raw_logs(tmp_path):
    proc, report = run_bench(tmp_path)
    assert report["failures"] == [] and "written" in proc.stdout
    parts = report["parts"]
    stalled = parts["stalled"]
    assert stalled["sockets"] == 40 and stalled["request_status"] == 200
    assert stalled["extra_fds"] <= 16 + 2  # the cap (16 in the quick run), and the metric scrape
    assert stalled["closed"]["evicted"] >= 40 - 16
    assert parts["short_body"]["status"] == 408 and parts["short_body"]["outcome"] == "closed"
    sigterm = parts["sigterm"]
    assert sigterm["late_request_status"] == 503 and sigterm["retry_after"] == "10"
    assert sigterm["stream_ended_with_done"] and sigterm["exit_status"] == 0
    # Finished within the grace, or cut cleanly: one or the other.
    assert sigterm["stream_finished"] != sigterm["stream_error_chunk"]
    trace = parts["tracestate"]
    assert not trace["raw_junk_in_stderr"] and trace["lines_without_timestamp"] == 0
    assert trace["ignored_counted"] == trace["requests"] == 3
