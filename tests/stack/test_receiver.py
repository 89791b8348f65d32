"""The alert receiver: Alertmanager's webhook payload in, one JSON line out, a bounded list over HTTP."""

from __future__ import annotations

import io
import json
import select
import subprocess
import sys
import threading

import pytest
import requests
from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue
from gpuscope.ops import procs
from gpuscope.receiver import main as receiver
from tests.conftest import promtool_check_metrics

COUNTER = catalogue.RECEIVER_NOTIFICATIONS.name


def notification(status: str = "firing", alertname: str = "GpuscopeLatencySpike") -> dict:
    """A payload shaped like Alertmanager 0.25's webhook (version 4)."""
    return {
        "version": "4", "groupKey": f'{{}}:{{alertname="{alertname}"}}', "truncatedAlerts": 0,
        "status": status, "receiver": "gpuscope-receiver",
        "groupLabels": {"alertname": alertname}, "commonLabels": {"alertname": alertname},
        "commonAnnotations": {}, "externalURL": "http://alertmanager:9093",
        "alerts": [{"status": status, "labels": {"alertname": alertname, "instance": "server:8000"},
                    "annotations": {"summary": "p99 TTFT high"}, "startsAt": "2026-01-01T00:00:00Z",
                    "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": "abc"}],
    }


@pytest.fixture
def running():
    out = io.StringIO()
    registry = CollectorRegistry()
    log = receiver.NotificationLog(capacity=3, registry=registry, out=out)
    server = receiver.make_server("127.0.0.1", 0, log, max_body_bytes=10_000)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield url, out, registry
    server.shutdown()
    server.server_close()


def test_notification_is_logged_listed_and_counted(running):
    url, out, registry = running
    r = requests.post(url + "/alerts", json=notification("firing"), timeout=5)
    assert r.status_code == 200, r.text
    requests.post(url + "/alerts", json=notification("resolved"), timeout=5).raise_for_status()

    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["event"] == "alertmanager_notification"
    assert first["notification"]["alerts"][0]["labels"]["alertname"] == "GpuscopeLatencySpike"

    listed = requests.get(url + "/alerts", timeout=5).json()["notifications"]
    assert [n["notification"]["status"] for n in listed] == ["firing", "resolved"]
    assert registry.get_sample_value(COUNTER, {"status": "firing"}) == 1
    assert registry.get_sample_value(COUNTER, {"status": "resolved"}) == 1


def test_list_is_bounded_and_limit_works(running):
    url, _, _ = running
    for name in ("A", "B", "C", "D"):
        requests.post(url + "/alerts", json=notification(alertname=name), timeout=5).raise_for_status()
    names = [n["notification"]["groupLabels"]["alertname"]
             for n in requests.get(url + "/alerts", timeout=5).json()["notifications"]]
    assert names == ["B", "C", "D"]  # capacity 3: the oldest went first
    limited = requests.get(url + "/alerts?limit=1", timeout=5).json()["notifications"]
    assert [n["notification"]["groupLabels"]["alertname"] for n in limited] == ["D"]


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"status": "weird", "alerts": []}).encode(), 422, "status"),
    (json.dumps({"status": "firing", "alerts": "x"}).encode(), 422, "alerts"),
    (json.dumps({"status": "firing", "alerts": [{"labels": 3}]}).encode(), 422, "alerts[0]"),
    (b"\xff\xfe", 400, "not JSON"),
    (b"x" * 20_000, 413, "limit"),
])
def test_bad_input_gets_4xx_json(running, body, status, needle):
    url, out, registry = running
    r = requests.post(url + "/alerts", data=body, headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == status
    assert needle in r.json()["error"]
    assert out.getvalue() == ""
    assert registry.get_sample_value(COUNTER, {"status": "firing"}) == 0


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/nope", 404), ("POST", "/metrics", 405), ("DELETE", "/alerts", 405),
    ("GET", "/alerts?limit=0", 400), ("GET", "/alerts?limit=x", 400),
])
def test_wrong_method_or_path_gets_json_error(running, method, path, status):
    url, _, _ = running
    r = requests.request(method, url + path, timeout=5)
    assert r.status_code == status
    assert r.json()["status"] == status


def test_metrics_pass_promtool(running):
    url, _, _ = running
    requests.post(url + "/alerts", json=notification(), timeout=5).raise_for_status()
    body = requests.get(url + "/metrics", timeout=5)
    assert COUNTER + '{status="firing"} 1.0' in body.text
    promtool_check_metrics(body.content)


def test_bad_flags_exit_with_one_line():
    for argv in (["--web.listen-address", "nope"], ["--receiver.history", "0"], ["--bogus"]):
        result = subprocess.run([sys.executable, "-m", "gpuscope", "receiver", *argv],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_command_serves_and_stops_on_sigterm(free_port):
    base = f"http://127.0.0.1:{free_port}"
    argv = [sys.executable, "-m", "gpuscope", "receiver", "--web.listen-address", f"127.0.0.1:{free_port}"]
    with procs.Child(argv, ready=base + "/healthz", stdout=subprocess.PIPE) as receiver:
        receiver.wait_ready(60)
        requests.post(base + "/alerts", json=notification(), timeout=30).raise_for_status()
        # One JSON line per notification on stdout, read as it comes (the pipe is ours to drain).
        readable, _, _ = select.select([receiver.popen.stdout], [], [], 60)
        assert readable, "no notification line on the receiver's stdout within 60 s"
        line = receiver.popen.stdout.readline()
        assert json.loads(line)["notification"]["status"] == "firing"
        assert receiver.stop() == 0, receiver.tail()
