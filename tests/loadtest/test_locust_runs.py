"""``locust -f loadtest/`` end to end, in child processes, as users run it."""

from __future__ import annotations

import csv
import itertools
import json
import statistics
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from gpuscope.loadtest.recorder import load_samples
from gpuscope.loadtest.serverproc import ServerProcess
from gpuscope.loadtest.stats import percentile

from ..conftest import wait_for
from .conftest import LocustProcess, csv_request_count, run_locust


def _locust_rows(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def _until_every_user_is_held(server, locust, users: int, finished: int, prefix: Path) -> None:
    """Until each user waits in a held stream and Locust's CSV counts every finished request.

    Held streams never finish, so from then on no figure changes: the test can stop Locust when it
    likes, and every user is mid-stream when it does.
    """
    wait_for(lambda: locust.running() and len(server.held) == users, timeout=120,
             what=f"all {users} users in a held stream")
    assert len(server.received) == finished + users
    wait_for(lambda: locust.running() and csv_request_count(prefix, "end_to_end") == finished,
             timeout=30, what="Locust's CSV (rewritten every second) to count every finished request")


def test_stream_timings_entries_and_tenant_weights(paced_server, tmp_path):
    first_s, gap_s, finished = 0.2, 0.1, 40
    paced_server.first_s, paced_server.gap_s, paced_server.hold_after = first_s, gap_s, finished
    samples, prefix = tmp_path / "samples.json", tmp_path / "run"
    with LocustProcess(["--host", paced_server.url, "-u", "8", "-r", "8",
                        "--output-tokens", "fixed:n=4", "--samples-file", str(samples),
                        "--csv", str(prefix), "--only-summary"], tmp_path,
                       env={"GPUSCOPE_LOAD_TENANTS": "alpha:3,beta:1"}) as locust:
        _until_every_user_is_held(paced_server, locust, 8, finished, prefix)
        result = locust.stop()
    assert result.returncode == 0, result.stderr[-2000:]
    # What the drill and compare look for before a second Ctrl-C (runtools.locust_ignored_ctrl_c).
    assert "Shutting down" in result.stderr
    everything = load_samples(samples)["requests"]
    requests = [r for r in everything if not r["cut"]]
    ok = [r for r in requests if r["ok"]]
    assert len(ok) == len(requests) == finished
    # Users stopped mid-stream leave what they received, marked cut, never as errors: all 8 were.
    cut = [r for r in everything if r["cut"]]
    assert len(cut) == 8 and all(r["error"] is None and r["e2e"] is None and r["tokens"] <= 1 for r in cut)

    # Streaming is read line by line: a buffered reader would see the first token only with a later
    # one (a gap later at least), or all of them at the end, with no gaps between them.
    assert first_s <= statistics.median(r["ttft"] for r in ok) < first_s + gap_s
    gaps = [g for r in ok for g in r["itl"]]
    assert len(gaps) == 3 * len(ok)
    assert 0.5 * gap_s <= percentile(gaps, 50) <= 1.5 * gap_s
    assert all(r["tokens"] == 4 for r in ok)

    # Locust's own entries, counted from the same requests.
    rows = _locust_rows(prefix)
    assert int(rows["end_to_end"]["Request Count"]) == len(ok)
    assert int(rows["time_to_first_token"]["Request Count"]) == len(ok)
    assert int(rows["inter_token_latency"]["Request Count"]) == len(gaps)
    assert int(rows["output_tokens"]["Request Count"]) == 4 * len(ok)

    # Tenants: 6 alpha users and 2 beta users (one held stream each), every request carrying its
    # tenant header.
    assert Counter(r["tenant"] for r in paced_server.held) == {"alpha": 6, "beta": 2}
    assert {r["tenant"] for r in paced_server.received} == {"alpha", "beta"}
    assert "gpuscope exact [beta]" in result.stderr


def test_errors_and_figures_from_several_processes_reach_the_master(paced_server, tmp_path):
    finished = 24  # every 4th of them fails: 6 errors
    paced_server.first_s, paced_server.gap_s, paced_server.fail_every = 0.02, 0.01, 4
    paced_server.hold_after = finished
    samples, prefix = tmp_path / "samples.json", tmp_path / "run"
    with LocustProcess(["--host", paced_server.url, "--processes", "2", "-u", "4", "-r", "4",
                        "--output-tokens", "fixed:n=3", "--samples-file", str(samples),
                        "--csv", str(prefix), "--only-summary"], tmp_path) as locust:
        # The master's CSV counts what the workers reported; their samples come in the same reports.
        _until_every_user_is_held(paced_server, locust, 4, finished, prefix)
        result = locust.stop()
    # Locust exits 1 when requests failed, which they did on purpose.
    assert result.returncode == 1, result.stderr[-2000:]
    requests = [r for r in load_samples(samples)["requests"] if not r["cut"]]
    rows = _locust_rows(prefix)
    assert int(rows["end_to_end"]["Request Count"]) == len(requests) == finished
    failed = [r for r in requests if not r["ok"]]
    assert int(rows["end_to_end"]["Failure Count"]) == len(failed) == finished // 4
    assert all(r["error"].startswith("HTTP 503") for r in failed)


def test_spike_shape_drives_the_user_count(paced_server, tmp_path):
    paced_server.first_s, paced_server.gap_s = 0.05, 0.02
    prefix = tmp_path / "spike"
    result = run_locust(["--host", paced_server.url, "--shape", "spike", "-u", "10", "-t", "10s",
                         "--csv", str(prefix), "--csv-full-history", "--only-summary"])
    assert result.returncode == 0, result.stderr[-2000:]
    with open(f"{prefix}_stats_history.csv") as f:
        counts = [int(row["User Count"]) for row in csv.DictReader(f) if row["Name"] == "Aggregated"]
    # Locust writes a row a second, whenever its writer gets to it: between the plateaus a row may
    # catch users still arriving or leaving (and the last one the stop), so compare the plateaus:
    # 30% of the peak before the spike (0-4 s), the peak (4-6 s), 30% again (6-10 s).
    plateaus = [count for count, _ in itertools.groupby(counts) if count in (3, 10)]
    assert plateaus == [3, 10, 3], counts
    assert max(counts) == 10


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--prompt-tokens", "gauss:mean=3"], {}, "unknown distribution 'gauss'"),
    (["--shape", "sawtooth"], {}, "unknown shape 'sawtooth'"),
    (["--temperature", "hot"], {}, "temperature 'hot' is not a number"),
    (["--temperature", "2.5"], {}, "temperature '2.5' is outside 0..2"),
    (["--ignore-eos", "maybe"], {}, "'maybe' is not true or false"),
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
