"""The command: flags in the style of the others (one line, exit 2), JSON, exit statuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuscope.util.freeport import free_port
from tests.conftest import usage_error


@pytest.mark.parametrize("argv, says", [
    (("--since", "5x"), "--since"),
    (("--since", "30s"), "at least 1m"),
    (("--duration", "soon"), "--duration"),
    (("--duration", "1s", "--interval", "2s"), "longer than --duration"),
    (("--server", "ftp://host/metrics"), "--server"),
    (("--prometheus", "localhost:9090"), "--prometheus"),
    (("--no-such-flag",), "unrecognized"),
    (("--since", "30m"), "--since chooses a past window and needs --prometheus URL"),
    (("--host", "gpu-node-3"), "--host chooses a past window and needs --prometheus URL"),
    (("--si=2h",), "--since"),  # argparse's unique prefix is the same flag
])
def test_bad_flag_is_one_line_and_exit_2(argv: tuple[str, ...], says: str) -> None:
    assert says in usage_error("gpuscope", "diagnose", *argv)


def test_json_on_a_box_without_gpu_or_server_finds_no_problem() -> None:
    result = subprocess.run([sys.executable, "-m", "gpuscope", "diagnose", "--duration", "0.4s",
                             "--interval", "0.2s", "--server", "", "--json"],
                            capture_output=True, text=True, timeout=60)
    document = json.loads(result.stdout)
    summary = document["summaries"][0]["summary"]
    assert result.returncode == document["exit_status"] == 0, result.stderr
    assert summary["source"] == "live" and summary["cpu"] is not None
    assert document["summaries"][0]["findings"] == []  # no GPU and no server: no pattern can hold


def test_unreachable_prometheus_exits_3_with_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, "-m", "gpuscope", "diagnose", "--prometheus", url],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert len(result.stderr.strip().splitlines()) == 1 and "not reachable" in result.stderr


def _diagnose_json(*argv: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "gpuscope", "diagnose", "--duration", "0.4s",
                             "--interval", "0.2s", "--json", *argv], capture_output=True, text=True,
                            timeout=60, env=env)
    return result.returncode, json.loads(result.stdout)


def test_a_named_server_that_does_not_answer_is_a_problem() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    status, document = _diagnose_json("--server", url)
    (finding,) = document["summaries"][0]["findings"]
    assert status == document["exit_status"] == 1
    assert finding["code"] == "server_unreachable" and finding["severity"] == "problem"
    assert finding["title"].startswith(f"server at {url} did not answer: ")


def test_history_flags_in_the_environment_do_not_stop_a_live_run() -> None:
    # GPUSCOPE_HOST is also what the fleet's vmagent reads: a standing setting, not a request.
    env = {**os.environ, "GPUSCOPE_HOST": "gpu-node-3", "GPUSCOPE_SINCE": "2h"}
    status, document = _diagnose_json("--server", "", env=env)
    assert status == 0 and document["summaries"][0]["summary"]["source"] == "live"


def test_the_default_server_address_is_tried_but_not_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuscope.diagnose.main import DEFAULT_SERVER, parse_args

    monkeypatch.delenv("GPUSCOPE_SERVER", raising=False)
    assert parse_args([]).server is None  # main tries DEFAULT_SERVER, a finding only if named
    assert parse_args(["--server", DEFAULT_SERVER]).server == DEFAULT_SERVER
