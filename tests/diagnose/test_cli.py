"""The command: flags in the style of the others (one line, exit 2), JSON, exit statuses."""

from __future__ import annotations

import json
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
