"""A firing latency alert brings back a kernel profile: real Alertmanager → real receiver → real server.

CPU only, so the capture is the timer's region fallback. The receiver knows the server only through
its allow-list of servers; an alert naming another instance is recorded and never followed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from gpuscope.contract import catalogue as c
from gpuscope.ops import procs
from gpuscope.receiver import profile_trigger
from gpuscope.util.freeport import free_ports
from tests.alerts.conftest import start_alertmanager
from tests.conftest import wait_for
from tests.stack.test_receiver import notification

TOKEN = "stack-profile-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INSTANCE = "sick-server:8000"  # the label Prometheus would give the server's target


def _env() -> dict[str, str]:
    return {**os.environ, "GPUSCOPE_PROFILE_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def chain(tmp_path: Path):
    ports = free_ports(["server", "receiver"])
    server_url = f"http://127.0.0.1:{ports['server']}"
    receiver_url = f"http://127.0.0.1:{ports['receiver']}"
    servers = tmp_path / "profile-servers.json"
    servers.write_text(json.dumps({"servers": {INSTANCE: server_url}, "steps": 5}))
    server = procs.Child(
        [sys.executable, "-m", "gpuscope", "serve", "--web.listen-address", f"127.0.0.1:{ports['server']}",
         "--model.layers", "1", "--model.dim", "64", "--model.heads", "4", "--model.context", "256",
         "--request.max-tokens", "64",
         "--timing", "all", "--profile.enable", "--profile.dir", tmp_path / "traces",
         "--profile.min-interval", "3600"],
        name="gpuscope serve", env=_env(), log_path=tmp_path / "server.log", ready=server_url + "/readyz")
    receiver = procs.Child(
        [sys.executable, "-m", "gpuscope", "receiver",
         "--web.listen-address", f"127.0.0.1:{ports['receiver']}", "--receiver.profile-servers", servers],
        name="gpuscope receiver", env=_env(), log_path=tmp_path / "receiver.log",
        ready=receiver_url + "/healthz")
    am_config = f"""
route:
  receiver: gpuscope
  group_by: [alertname, instance]
  group_wait: 1s
  group_interval: 1m
  repeat_interval: 1h
receivers:
  - name: gpuscope
    webhook_configs:
      - url: {receiver_url}/alerts
"""
    with server, receiver:
        server.wait_ready(120)
        receiver.wait_ready(60)
        am = start_alertmanager(am_config, tmp_path)
        try:
            yield next(am), server_url, receiver_url, server
        finally:
            am.close()


def _load(url: str, stop: threading.Event) -> None:
    deadline = time.monotonic() + 120
    for _ in range(500):
        if stop.is_set() or time.monotonic() > deadline:
            return
        try:
            requests.post(url + "/v1/completions", json={"prompt": "slow?", "max_tokens": 16}, timeout=30)
        except requests.RequestException:
            return


def _records(receiver_url: str) -> list[dict]:
    return requests.get(receiver_url + "/alerts", timeout=10).json()["notifications"]


def _metric(url: str, name: str, labels: str) -> float:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{{labels}}} not on {url}/metrics")


def test_firing_latency_alert_captures_a_profile_linked_from_the_notification(chain):
    am, server_url, receiver_url, server = chain
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(server_url, stop), daemon=True)
    load.start()
    try:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        am.post([
            {"labels": {"alertname": "GPUStepLatencySpike", "instance": INSTANCE, "severity": "warning"},
             "annotations": {"summary": "decode steps slow"}, "startsAt": now},
            # Not in the allow-list: recorded, never called (an alert label never picks a host).
            {"labels": {"alertname": "GPUStepLatencySpike", "instance": "attacker.example:80"},
             "startsAt": now},
            # Not a latency alert: no profile.
            {"labels": {"alertname": "GPUMemoryLeak", "instance": INSTANCE}, "startsAt": now},
        ])

        def profiled() -> dict[str, dict] | None:
            entries = {p["instance"]: p for r in _records(receiver_url) for p in r.get("profiles", [])}
            return entries if len(entries) == 2 else None

        entries = wait_for(profiled, timeout=60, what="both latency notifications with their profile entries")
        asked = entries[INSTANCE]
        assert asked["result"] == "requested", asked
        assert asked["trace_url"] == f"{server_url}/admin/profile/{asked['id']}/trace"
        assert entries["attacker.example:80"]["result"] == "not_allowed"
        leak = [r for r in _records(receiver_url)
                if r["notification"]["groupLabels"].get("alertname") == "GPUMemoryLeak"]
        assert leak and leak[0]["profiles"] == []

        def written() -> dict | None:
            status = requests.get(asked["status_url"], headers=AUTH, timeout=10).json()
            return status if status["state"] == "done" else None

        status = wait_for(written, timeout=60, what="the capture written")
    finally:
        stop.set()
        load.join(60)
    assert status["outcome"] == "ok" and status["steps_captured"] == 5, status
    assert status["alert"]["alertname"] == "GPUStepLatencySpike"

    trace = requests.get(asked["trace_url"], headers=AUTH, timeout=10).json()
    regions = [e for e in trace["traceEvents"] if e.get("cat") == "region"]
    assert {"blocks.0.attn", "blocks.0.mlp"} <= {e["name"] for e in regions}
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in regions)

    # The server's structured log (what it ships to Loki) links the same trace.
    def logged() -> list[dict]:
        lines = [line for line in server.output().splitlines() if '"event":"profile_captured"' in line]
        return [json.loads(line[line.index("{"):]) for line in lines]

    line = wait_for(logged, timeout=30, what="the profile_captured log line")[0]
    assert line["capture_id"] == asked["id"]
    assert line["trace_url"].endswith(f"/admin/profile/{asked['id']}/trace")
    assert line["alertname"] == "GPUStepLatencySpike"

    # Alertmanager re-sends while the alert fires: the server's interval turns the repeat away.
    repeat = notification("firing", "GPUStepLatencySpike")
    repeat["alerts"][0]["labels"]["instance"] = INSTANCE
    again = requests.post(receiver_url + "/alerts", json=repeat, timeout=30)
    assert again.status_code == 200
    last = _records(receiver_url)[-1]["profiles"][0]
    assert last["result"] == "rate_limited" and int(last["retry_after_s"]) > 3000, last
    assert _metric(receiver_url, c.RECEIVER_PROFILE_REQUESTS.name, 'result="requested"') == 1
    assert _metric(receiver_url, c.RECEIVER_PROFILE_REQUESTS.name, 'result="not_allowed"') == 1
    assert _metric(receiver_url, c.RECEIVER_PROFILE_REQUESTS.name, 'result="rate_limited"') == 1
    assert _metric(server_url, c.PROFILE_REQUESTS.name, 'result="accepted"') == 1


def test_default_alerts_are_the_latency_alerts_and_their_composite():
    from gpuscope.alerting import composite, latency
    from gpuscope.contract.profiles import PROFILES

    names = {a.name for g in latency.groups(PROFILES["production"]) for a in g.alerts()}
    assert set(profile_trigger.DEFAULT_ALERTS) == (
        {composite.COMPOSITE, *composite.COMPONENTS["latency_spike"]} | {"GPURequestLatencySpike"})
    assert set(profile_trigger.DEFAULT_ALERTS) - {composite.COMPOSITE} <= names


@pytest.mark.parametrize(("servers", "token_env", "needle"), [
    ({"servers": {}}, TOKEN, "needs"),
    ({"servers": {"a:1": "ftp://x"}}, TOKEN, "base URL"),
    ({"servers": {"a:1": "http://x:1/admin"}}, TOKEN, "base URL"),
    ({"servers": {"a:1": "http://x:1"}, "steps": 0}, TOKEN, "steps"),
    ({"servers": {"a:1": "http://x:1"}, "extra": 1}, TOKEN, "unknown key"),
    ({"servers": {"a:1": "http://x:1"}}, "", "token"),
])
def test_bad_servers_file_is_one_line_and_exit_2(tmp_path, servers, token_env, needle):
    path = tmp_path / "servers.json"
    path.write_text(json.dumps(servers))
    env = {**os.environ, "GPUSCOPE_PROFILE_TOKEN": token_env}
    argv = [sys.executable, "-m", "gpuscope", "receiver", "--receiver.profile-servers", path]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr, result.stderr


def test_trigger_records_unreachable_and_ignores_resolved(free_port):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    config = profile_trigger.TriggerConfig({INSTANCE: f"http://127.0.0.1:{free_port}"}, TOKEN, timeout_s=2.0)
    trigger = profile_trigger.ProfileTrigger(config, registry)
    firing = notification("firing", "GPUKernelLatencySpike")
    firing["alerts"][0]["labels"]["instance"] = INSTANCE
    firing["alerts"].append({**firing["alerts"][0], "status": "resolved"})  # same instance: one call
    [entry] = trigger.on_notification(firing)
    assert entry["result"] == "unreachable" and entry["instance"] == INSTANCE, entry
    assert trigger.on_notification(notification("resolved", "GPUKernelLatencySpike")) == []
    name = c.RECEIVER_PROFILE_REQUESTS.name
    assert registry.get_sample_value(name, {"result": "unreachable"}) == 1
    assert registry.get_sample_value(name, {"result": "requested"}) == 0
