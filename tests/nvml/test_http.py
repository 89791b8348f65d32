"""A real HTTP scrape of a running exporter: formats, endpoints, errors, promtool, the command itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests

from gpuscope import catalogue as cat
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.server import ExporterServer
from tests.conftest import promtool_check_metrics, wait_for
from tests.nvml.conftest import value, wait_first_rounds
from tests.nvml.fake_nvml import FakeGpu, FakeNvml, FakeProcess


@pytest.fixture
def served(start_exporter) -> Iterator[tuple[str, Exporter]]:
    nv = FakeNvml([FakeGpu(processes=[FakeProcess(os.getpid(), 2**30)], proc_samples=[(os.getpid(), 5, 12)],
                           nvlink_kib=(1, 2)), FakeGpu()])
    ex = start_exporter(nv, collectors=frozenset({"device", "clock_events", "energy", "remapped_rows",
                                                  "nvlink", "xid", "pcie_throughput", "processes"}))
    server = ExporterServer(("127.0.0.1", 0), ex.metrics, ex.healthz)
    server.serve_in_thread()
    wait_first_rounds(ex)
    wait_for(lambda: value(ex, cat.GPU_XID_ERRORS.name, gpu="1", xid="79") is not None, what="xid thread")
    yield server.url, ex
    server.shutdown()
    server.server_close()


def test_metrics_exposition_passes_promtool(served) -> None:
    url, _ = served
    response = requests.get(url + "/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    body = response.text
    for metric in (cat.GPU_UTILIZATION, cat.GPU_ENERGY, cat.GPU_CLOCK_EVENT_SECONDS, cat.GPU_XID_ERRORS,
                   cat.GPU_PROCESS_MEMORY, cat.GPU_INFO, cat.EXPORTER_STALENESS, cat.GPU_NVLINK_BYTES):
        assert f"\n{metric.name}{{" in body, metric.name
    promtool_check_metrics(body)


def test_openmetrics_when_asked(served) -> None:
    url, _ = served
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
    response = requests.get(url + "/metrics", headers=accept, timeout=5)
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert f"{cat.GPU_ENERGY.name}{{" in response.text


def test_index_healthz_and_errors(served) -> None:
    url, _ = served
    index = requests.get(url + "/", timeout=5)
    assert index.status_code == 200 and 'href="/metrics"' in index.text
    health = requests.get(url + "/healthz", timeout=5).json()
    assert health["status"] == "ok" and health["gpus"] == 2 and health["nvml"] is True
    assert set(health["staleness_seconds"]) >= {"device", "energy", "xid"}
    missing = requests.get(url + "/metricz", timeout=5)
    assert missing.status_code == 404 and missing.json()["endpoints"] == ["/", "/metrics", "/healthz"]
    posted = requests.post(url + "/metrics", data=b"x" * 1000, timeout=5)
    assert posted.status_code == 405 and "not allowed" in posted.json()["error"]
    assert requests.head(url + "/metrics", timeout=5).status_code == 200


def test_malformed_request_gets_json_4xx(served) -> None:
    url, _ = served
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /a b HTTP/1.1\r\n\r\n")  # four words: bad request syntax
        chunks = []
        while chunk := sock.recv(4096):  # the server closes after an error
            chunks.append(chunk)
        reply = b"".join(chunks).decode()
    status = int(reply.split()[1])
    assert 400 <= status < 500
    assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_without_nvml_and_stops_on_sigterm() -> None:
    """The real entry point on this machine (no libnvidia-ml): zero GPUs, health served, clean exit."""
    port = _free_port()
    env = {**os.environ, "GPUSCOPE_WEB_LISTEN_ADDRESS": f"127.0.0.1:{port}"}
    proc = subprocess.Popen([sys.executable, "-m", "gpuscope", "exporter"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        def scrape() -> str | None:
            try:
                return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
            except requests.ConnectionError:
                return None
        body = wait_for(scrape, timeout=30, what="exporter to listen")
        assert f"{cat.EXPORTER_GPUS.name} " in body
        promtool_check_metrics(body)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert sum("NVML unavailable" in line for line in err.splitlines()) <= 1


def test_busy_port_is_one_line_and_exit_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = [sys.executable, "-m", "gpuscope", "exporter", f"--web.listen-address=127.0.0.1:{port}"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "cannot listen" in result.stderr
