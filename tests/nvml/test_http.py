"""A real HTTP scrape of a running exporter: formats, endpoints, errors, promtool, the command itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.http import ExporterServer
from gpuscope.ops import procs
from gpuscope.util.freeport import free_port
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



def test_the_command_serves_without_nvml_and_stops_on_sigterm() -> None:
    """The real entry point on this machine (no libnvidia-ml): zero GPUs, health served, clean exit."""
    port = free_port()
    env = {**os.environ, "GPUSCOPE_WEB_LISTEN_ADDRESS": f"127.0.0.1:{port}"}
    url = f"http://127.0.0.1:{port}/metrics"
    with procs.Child([sys.executable, "-m", "gpuscope", "exporter"], env=env, ready=url) as exporter:
        exporter.wait_ready(30)
        body = requests.get(url, timeout=30).text
        assert f"{cat.EXPORTER_GPUS.name} " in body
        promtool_check_metrics(body)
        assert exporter.stop() == 0, exporter.tail()
    assert sum("NVML unavailable" in line for line in exporter.output().splitlines()) <= 1


def test_busy_port_is_one_line_and_exit_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = [sys.executable, "-m", "gpuscope", "exporter", f"--web.listen-address=127.0.0.1:{port}"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "cannot listen" in result.stderr


# --- connection limits and read timeouts ---------------------------------------------------------

TEXT = "text/plain; version=0.0.4; charset=utf-8"
CLOSED = cat.EXPORTER_HTTP_CONNECTIONS_CLOSED.name


def _serve(metrics=None, **limits) -> ExporterServer:
    server = ExporterServer(("127.0.0.1", 0), metrics or (lambda accept: (b"up 1\n", TEXT)),
                            lambda: {"status": "ok"}, **limits)
    server.serve_in_thread()
    return server


def _stop(server: ExporterServer) -> None:
    server.shutdown()
    server.server_close()


def _closed(url: str, reason: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == CLOSED and sample.labels == {"reason": reason}:
                return sample.value
    return None


def _connection_threads() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name == "gpuscope-http-conn")


def _half_sent(server: ExporterServer) -> socket.socket:
    sock = socket.create_connection(server.server_address[:2], timeout=30)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: the request never ends
    return sock


def test_half_sent_connections_keep_threads_bounded_and_scrapes_working() -> None:
    """Before: every half-sent request held a thread forever (500 sockets, 502 threads)."""
    server = _serve(max_connections=8, read_timeout=300.0)  # no timeout during the test
    sockets = []
    try:
        for _ in range(200):
            sockets.append(_half_sent(server))
            assert _connection_threads() <= 8
        # The scrape's connection is accepted after all of them (backlog order) and evicts the
        # longest-waiting one: it is answered at once, not after a read timeout.
        response = requests.get(server.url + "/metrics", timeout=60)
        assert response.status_code == 200 and response.text.startswith("up 1\n")
        assert _connection_threads() <= 8
        # Connections the kernel's backlog held back are accepted later, each evicting another.
        wait_for(lambda: _closed(server.url, "evicted") >= 200 - 8, timeout=60, what="evictions counted")
        assert _connection_threads() <= 8
        assert _closed(server.url, "refused") == 0
    finally:
        for sock in sockets:
            sock.close()
        _stop(server)


def test_at_the_limit_with_every_connection_busy_a_new_one_is_refused_with_503() -> None:
    import threading

    release, inside = threading.Event(), threading.Event()

    def slow_metrics(accept: str) -> tuple[bytes, str]:
        if not inside.is_set():
            inside.set()
            assert release.wait(60)
        return b"up 1\n", TEXT

    server = _serve(slow_metrics, max_connections=1, read_timeout=300.0)
    host, port = server.server_address[:2]
    busy = socket.create_connection((host, port), timeout=60)
    try:
        busy.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert inside.wait(30), "the first scrape never reached the handler"
        status, headers, body = _raw(host, port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and headers["content-type"] == "application/json"
        assert "--web.max-connections" in json.loads(body)["error"]
        release.set()
        assert b"200 OK" in busy.recv(4096)
    finally:
        release.set()
        busy.close()
    wait_for(lambda: _closed(server.url, "refused") == 1, timeout=30, what="the refusal counted")
    _stop(server)


def _raw(host: str, port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("sent", [b"", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"], ids=["idle", "half-sent"])
def test_connection_without_a_complete_request_is_closed_after_the_read_timeout(sent) -> None:
    import time

    server = _serve(read_timeout=0.5)
    try:
        with socket.create_connection(server.server_address[:2], timeout=60) as sock:
            opened = time.monotonic()
            sock.sendall(sent)
            assert sock.recv(4096) == b""  # the server closed it (blocks until then; 60 s socket limit)
            assert time.monotonic() - opened >= 0.5
        wait_for(lambda: _closed(server.url, "timeout") == 1, timeout=30, what="the timeout counted")
    finally:
        _stop(server)


def test_read_timeout_bounds_a_whole_request_not_each_read() -> None:
    """A client dripping a byte at a time cannot keep a connection past the read timeout."""
    import time

    server = _serve(read_timeout=1.0)
    request = b"GET /metrics HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 2000 + b"\r\n\r\n"
    try:
        with socket.create_connection(server.server_address[:2], timeout=60) as sock:
            closed = False
            for byte in request:
                try:
                    sock.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                time.sleep(0.05)  # pacing of the drip (2,000 bytes: 100 s if never cut off)
            assert closed, "the dripping client was never cut off"
    finally:
        _stop(server)


def test_keep_alive_connection_serves_requests_one_after_another() -> None:
    server = _serve(read_timeout=5.0, max_connections=1)
    try:
        with requests.Session() as session:
            for _ in range(3):
                assert session.get(server.url + "/metrics", timeout=30).status_code == 200
    finally:
        _stop(server)


def test_openmetrics_answer_passes_a_strict_openmetrics_parser(served) -> None:
    """promtool check metrics (2.42) reads the Prometheus text format only: on OpenMetrics it fails on
    `_total` ("no help text") and exemplars. The OpenMetrics answer goes through prometheus_client's
    strict OpenMetrics parser instead; promtool keeps checking the text answer (above)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    url, _ = served
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
    text = requests.get(url + "/metrics", headers=accept, timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for metric in (cat.GPU_ENERGY, cat.GPU_XID_ERRORS, cat.GPU_INFO, cat.GPU_UTILIZATION,
                   cat.EXPORTER_HTTP_CONNECTIONS_CLOSED):
        assert families[metric.base_name].type == metric.type, metric.name


def _run_exporter(*args: str, env: dict[str, str] | None = None) -> tuple[procs.Child, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "gpuscope", "exporter", f"--web.listen-address=127.0.0.1:{port}", *args]
    exporter = procs.Child(argv, env={**os.environ, **(env or {})}, ready=url + "/metrics").start()
    exporter.wait_ready(30)
    return exporter, url


def _sigterm(exporter: procs.Child) -> None:
    assert exporter.stop() == 0, exporter.tail()


def test_the_command_takes_its_read_timeout_from_the_flag() -> None:
    proc, url = _run_exporter("--web.read-timeout", "500ms")
    try:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as idle:
            assert idle.recv(1) == b""  # closed by the 500 ms read timeout
        wait_for(lambda: _closed(url, "timeout") == 1, timeout=30, what="the timeout counted")
    finally:
        _sigterm(proc)


def test_the_command_takes_its_connection_limit_from_the_environment() -> None:
    proc, url = _run_exporter(env={"GPUSCOPE_WEB_MAX_CONNECTIONS": "2"})  # read timeout: 30 s default
    port = int(url.rsplit(":", 1)[1])
    sockets = []
    try:
        for _ in range(6):
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            sockets.append(sock)
        assert requests.get(url + "/metrics", timeout=30).status_code == 200
        # 6 half-sent and 1 scrape through 2 slots: at least 5 evictions.
        wait_for(lambda: _closed(url, "evicted") >= 5, timeout=30, what="evictions counted")
    finally:
        for sock in sockets:
            sock.close()
        _sigterm(proc)


@pytest.mark.parametrize("args, message", [
    (["--web.max-connections", "0"], "--web.max-connections: '0' is not a whole number of at least 1"),
    (["--web.read-timeout", "soon"], "'soon' is not a duration"),
    (["--web.read-timeout", "0s"], "must be greater than zero"),
])
def test_bad_connection_limits_exit_2_with_one_line(args, message) -> None:
    result = subprocess.run([sys.executable, "-m", "gpuscope", "exporter", *args], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
