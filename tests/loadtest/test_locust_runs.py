"""``locust -f loadtest/`` end to end, in child processes, as users run it."""

from __future__ import annotations

import csv
import json
import statistics
import urllib.request
from pathlib import Path

import pytest

from gpuscope.loadtest.recorder import load_samples
from gpuscope.loadtest.serverproc import ServerProcess
from gpuscope.loadtest.stats import percentile

from .conftest import run_locust


def _locust_rows(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def test_stream_timings_entries_and_tenant_weights(paced_server, tmp_path):
    paced_server.first_s, paced_server.gap_s = 0.15, 0.05
    samples, prefix = tmp_path / "samples.json", tmp_path / "run"
    result = run_locust(["--host", paced_server.url, "-u", "8", "-r", "8", "-t", "5s",
                         "--output-tokens", "fixed:n=4", "--samples-file", str(samples),
                         "--csv", str(prefix), "--only-summary"],
                        env={"GPUSCOPE_LOAD_TENANTS": "alpha:3,beta:1"})
    assert result.returncode == 0, result.stderr[-2000:]
    everything = load_samples(samples)["requests"]
    requests = [r for r in everything if not r["cut"]]
    ok = [r for r in requests if r["ok"]]
    assert len(ok) >= 40 and len(ok) == len(requests)
    # Users stopped mid-stream leave what they received, marked cut, never as errors.
    cut = [r for r in everything if r["cut"]]
    assert cut and all(r["error"] is None and r["e2e"] is None and r["tokens"] <= 4 for r in cut)

    # Streaming is read line by line: a buffered reader would see the first token only at the end.
    assert 0.14 <= statistics.median(r["ttft"] for r in ok) <= 0.20
    gaps = [g for r in ok for g in r["itl"]]
    assert len(gaps) == 3 * len(ok)
    assert 0.045 <= percentile(gaps, 50) <= 0.07
    assert all(r["tokens"] == 4 for r in ok)

    # Locust's own entries, counted from the same requests.
    rows = _locust_rows(prefix)
    assert int(rows["end_to_end"]["Request Count"]) == len(ok)
    assert int(rows["time_to_first_token"]["Request Count"]) == len(ok)
    assert int(rows["inter_token_latency"]["Request Count"]) == len(gaps)
    assert int(rows["output_tokens"]["Request Count"]) == 4 * len(ok)

    # Tenants: 6 alpha users and 2 beta users, each request carrying its tenant header.
    tenants = [r["tenant"] for r in paced_server.received]
    assert set(tenants) == {"alpha", "beta"}
    assert 2.2 <= tenants.count("alpha") / tenants.count("beta") <= 4.0
    assert "gpuscope exact [beta]" in result.stderr


def test_errors_and_figures_from_several_processes_reach_the_master(paced_server, tmp_path):
    paced_server.first_s, paced_server.gap_s, paced_server.fail_every = 0.02, 0.01, 4
    samples, prefix = tmp_path / "samples.json", tmp_path / "run"
    result = run_locust(["--host", paced_server.url, "--processes", "2", "-u", "4", "-r", "4", "-t", "4s",
                         "--output-tokens", "fixed:n=3", "--samples-file", str(samples),
                         "--csv", str(prefix), "--only-summary"])
    # Locust exits 1 when requests failed, which they did on purpose.
    assert result.returncode == 1, result.stderr[-2000:]
    requests = [r for r in load_samples(samples)["requests"] if not r["cut"]]
    rows = _locust_rows(prefix)
    assert int(rows["end_to_end"]["Request Count"]) == len(requests) > 20
    failed = [r for r in requests if not r["ok"]]
    assert int(rows["end_to_end"]["Failure Count"]) == len(failed) > 0
    assert all(r["error"].startswith("HTTP 503") for r in failed)


def test_spike_shape_drives_the_user_count(paced_server, tmp_path):
    paced_server.first_s, paced_server.gap_s = 0.05, 0.02
    prefix = tmp_path / "spike"
    result = run_locust(["--host", paced_server.url, "--shape", "spike", "-u", "10", "-t", "10s",
                         "--csv", str(prefix), "--csv-full-history", "--only-summary"])
    assert result.returncode == 0, result.stderr[-2000:]
    with open(f"{prefix}_stats_history.csv") as f:
        counts = [int(row["User Count"]) for row in csv.DictReader(f) if row["Name"] == "Aggregated"]
    assert max(counts) == 10
    assert counts[1] == 3  # 30% of the peak before the spike
    assert counts.index(10) >= 3 and counts[-1] == 3


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--prompt-tokens", "gauss:mean=3"], {}, "unknown distribution 'gauss'"),
    (["--shape", "sawtooth"], {}, "unknown shape 'sawtooth'"),
    ([], {"GPUSCOPE_LOAD_TENANTS": "alpha:0"}, "weights must be positive"),
])
def test_bad_options_fail_with_one_readable_line(args, env, needle):
    result = run_locust(["--host", "http://127.0.0.1:9", "-t", "1s", *args], env=env, timeout=60)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert sum(needle in line for line in result.stderr.splitlines()) == 1


def _metric_sum(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
def test_against_gpuscope_serve_the_counts_agree_with_the_server(tmp_path):
    samples = tmp_path / "samples.json"
    with ServerProcess(["--tenants", "alpha:0.5,beta:0.5", "--model.layers", "1"],
                       log_path=tmp_path / "serve.log") as server:
        result = run_locust(["--host", server.url, "-u", "4", "-r", "4", "-t", "6s",
                             "--output-tokens", "uniform:min=4,max=24", "--samples-file", str(samples),
                             "--only-summary"], env={"GPUSCOPE_LOAD_TENANTS": "alpha:1,beta:1"})
        assert result.returncode == 0, result.stderr[-2000:]
        served_by_tenant = {
            t: sum(_metric_sum(server.url, "gpuscope_requests_total", tenant=t, outcome=o)
                   for o in ("stop", "length"))
            for t in ("alpha", "beta")}
    requests = [r for r in json.loads(samples.read_text())["requests"] if not r["cut"]]
    assert requests and all(r["ok"] for r in requests)
    for tenant in ("alpha", "beta"):
        ours = sum(1 for r in requests if r["tenant"] == tenant)
        # The server finished every request we recorded, plus at most the ones cut off at the end.
        assert ours <= served_by_tenant[tenant] <= ours + 4
    assert all(1 <= r["tokens"] <= 24 for r in requests)
