"""Profile captures on CPU (the timer's region fallback): a real server app, real HTTP, real files."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import requests

from gpuscope.contract import catalogue as c
from gpuscope.server.config import ConfigError
from gpuscope.server.main import load_config
from gpuscope.server.profile import trace as pt
from gpuscope.server.profile.config import ProfileConfig
from tests.conftest import promtool_check_metrics, wait_for
from tests.server.conftest import ServerThread, small_config

PROFILE_TOKEN = "profile-token-0123456789"
AUTH = {"Authorization": f"Bearer {PROFILE_TOKEN}"}


def profile_config(directory, **overrides) -> ProfileConfig:
    base = {"enable": True, "token": PROFILE_TOKEN, "directory": str(directory), "min_interval_s": 0.0,
            "window_timeout_s": 20.0, **overrides}
    return ProfileConfig(**base).validate()


@pytest.fixture
def serve(tmp_path):
    servers: list[ServerThread] = []

    def start(timing: str = "all", **overrides) -> ServerThread:
        server = ServerThread(small_config(profile=profile_config(tmp_path / "traces", **overrides),
                                           timing=timing)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


class Load:
    """Completions from one thread until stopped (bounded in count and time), so the engine steps."""

    def __init__(self, url: str, max_requests: int = 400, max_s: float = 120.0) -> None:
        self.url, self.max_requests, self.max_s = url, max_requests, max_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        for _ in range(self.max_requests):
            if self._stop.is_set() or time.monotonic() > deadline:
                return
            try:
                requests.post(self.url + "/v1/completions", json={"prompt": "profile me", "max_tokens": 24},
                              timeout=30)
            except requests.RequestException:
                return

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def capture(server: ServerThread, **body) -> dict:
    r = requests.post(server.url + "/admin/profile", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 202, r.text
    return r.json()


def finished(server: ServerThread, capture_id: str) -> dict:
    def done():
        status = requests.get(server.url + f"/admin/profile/{capture_id}", headers=AUTH, timeout=10).json()
        return status if status["state"] == "done" else None

    return wait_for(done, timeout=60, what=f"capture {capture_id} written")


def assert_chrome_trace(trace: dict) -> None:
    """The Trace Event Format's JSON object form, as Perfetto and chrome://tracing read it."""
    assert isinstance(trace["traceEvents"], list)
    for event in trace["traceEvents"]:
        assert event["ph"] in ("X", "M"), event
        assert isinstance(event["name"], str)
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and event["dur"] >= 0, event


def test_capture_writes_a_chrome_trace_of_regions_and_steps(serve):
    server = serve()
    with Load(server.url):
        # Steps before the window are what its throughput is compared with.
        wait_for(lambda: (server.metric(c.BATCH_SIZE.name + "_count", {"phase": "decode"}) or 0) >= 20,
                 timeout=60, what="20 decode steps")
        started = capture(server, steps=6, reason="alert GPUStepLatencySpike",
                          alert={"alertname": "GPUStepLatencySpike", "instance": "x:1"})
        assert started["mode"] == "regions" and started["state"] in ("pending", "capturing")
        status = finished(server, started["id"])
    assert status["outcome"] == "ok" and status["steps_captured"] == 6, status
    assert os.path.basename(status["file"]) in pt.trace_files(os.path.dirname(status["file"]))

    r = requests.get(server.url + started["trace_path"], headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    trace = r.json()
    assert_chrome_trace(trace)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in spans if e["cat"] == "step"]
    regions = [e for e in spans if e["cat"] == "region"]
    assert len(steps) == 6 and {e["name"] for e in steps} <= {"prefill", "decode"}
    # Every instrumented module of the 1-layer model, in every captured step (full sampling).
    names = {e["name"] for e in regions}
    assert {"embed", "blocks.0.attn", "blocks.0.mlp", "lm_head"} <= names, names
    assert sum(e["name"] == "blocks.0.mlp" for e in regions) == 6
    assert all(e["args"]["timed"] for e in regions)
    assert trace["otherData"]["alert"]["alertname"] == "GPUStepLatencySpike"
    assert trace["otherData"]["steps_captured"] == 6

    assert server.metric(c.PROFILE_CAPTURES.name, {"mode": "regions", "outcome": "ok"}) == 1
    assert server.metric(c.PROFILE_TRACE_BYTES.name) == len(r.content)
    assert server.metric(c.PROFILE_TRACES_RETAINED.name) == 1
    loss = status["throughput_loss_ratio"]
    assert loss is not None and loss < 1
    assert server.metric(c.PROFILE_THROUGHPUT_LOSS.name) == pytest.approx(loss, abs=1e-4)
    promtool_check_metrics(requests.get(server.url + "/metrics", timeout=10).content)


def test_one_capture_per_interval_then_429_with_retry_after(serve):
    server = serve(min_interval_s=3600.0, window_timeout_s=0.5)
    first = capture(server, steps=1)
    r = requests.post(server.url + "/admin/profile", json={}, headers=AUTH, timeout=10)
    assert r.status_code in (409, 429), r.text  # 409 while the first is still running
    finished(server, first["id"])  # idle server: the window times out and writes what it has
    r = requests.post(server.url + "/admin/profile", json={}, headers=AUTH, timeout=10)
    assert r.status_code == 429, r.text
    assert 3500 <= int(r.headers["Retry-After"]) <= 3600
    assert "one capture per 3600s" in r.json()["error"]["message"]
    assert server.metric(c.PROFILE_REQUESTS.name, {"result": "rate_limited"}) >= 1
    assert server.metric(c.PROFILE_REQUESTS.name, {"result": "accepted"}) == 1


def test_idle_window_times_out_as_partial(serve):
    server = serve(window_timeout_s=0.3)
    status = finished(server, capture(server, steps=5)["id"])
    assert status["outcome"] == "partial" and status["steps_captured"] == 0
    trace = requests.get(server.url + status["trace_path"], headers=AUTH, timeout=10).json()
    assert_chrome_trace(trace)
    assert server.metric(c.PROFILE_CAPTURES.name, {"mode": "regions", "outcome": "partial"}) == 1


def test_event_cap_and_retention_hold(serve, tmp_path):
    server = serve(max_events=100, keep=2)
    ids = []
    with Load(server.url):
        for _ in range(3):
            ids.append(capture(server, steps=40)["id"])
            status = finished(server, ids[-1])
            assert status["events"] <= 100 and status["events_left_out"] > 0, status
    trace = requests.get(server.url + f"/admin/profile/{ids[-1]}/trace", headers=AUTH, timeout=10).json()
    assert len(trace["traceEvents"]) <= 100
    assert trace["otherData"]["events_left_out_count"] > 0
    assert server.metric(c.PROFILE_EVENTS_DROPPED.name, {"reason": "count_cap"}) > 0
    # Three written, two kept: the oldest file is gone and its trace answers 410.
    assert len(pt.trace_files(str(tmp_path / "traces"))) == 2
    assert server.metric(c.PROFILE_TRACES_RETAINED.name) == 2
    gone = requests.get(server.url + f"/admin/profile/{ids[0]}/trace", headers=AUTH, timeout=10)
    assert gone.status_code == 410 and "deleted" in gone.json()["error"]["message"]


@pytest.mark.parametrize(("body", "needle"), [
    (b"not json", "not valid JSON"),
    (b"[1]", "JSON object"),
    (json.dumps({"steps": 0}).encode(), "steps"),
    (json.dumps({"steps": 10_000}).encode(), "steps"),
    (json.dumps({"steps": True}).encode(), "steps"),
    (json.dumps({"mode": "gpu"}).encode(), "mode"),
    (json.dumps({"reason": 3}).encode(), "reason"),
    (json.dumps({"alert": {"a": 1}}).encode(), "alert"),
    (json.dumps({"nope": 1}).encode(), "unknown field 'nope'"),
])
def test_bad_requests_get_400_json_and_start_nothing(serve, body, needle):
    server = serve()
    r = requests.post(server.url + "/admin/profile", data=body, headers=AUTH, timeout=10)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert requests.get(server.url + "/admin/profile", headers=AUTH, timeout=10).json()["captures"] == []


def test_auth_and_unknown_ids(serve):
    server = serve()
    url = server.url + "/admin/profile"
    assert requests.post(url, json={}, timeout=10).status_code == 401
    wrong = requests.post(url, json={}, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "permission_error"
    assert requests.get(url + "/0123456789ab", headers=AUTH, timeout=10).status_code == 404
    assert requests.get(url + "/0123456789ab/trace", headers=AUTH, timeout=10).status_code == 404
    # Kernels need CUDA: on CPU that mode is refused, with what to ask for instead.
    r = requests.post(url, json={"mode": "kernels"}, headers=AUTH, timeout=10)
    assert r.status_code == 409 and "mode regions" in r.json()["error"]["message"]


def test_timing_off_has_no_regions_to_capture(serve):
    server = serve(timing="off")
    r = requests.post(server.url + "/admin/profile", json={}, headers=AUTH, timeout=10)
    assert r.status_code == 409 and "--timing off" in r.json()["error"]["message"]


def test_disabled_by_default():
    server = ServerThread(small_config()).start()
    try:
        r = requests.post(server.url + "/admin/profile", json={}, headers=AUTH, timeout=10)
        assert r.status_code == 404 and "--profile.enable" in r.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--profile.enable"], {}, "needs a token"),
    (["--profile.enable"], {"GPUSCOPE_PROFILE_TOKEN": "short"}, "at least 16"),
    (["--profile.enable", "--profile.keep", "0"], {"GPUSCOPE_PROFILE_TOKEN": PROFILE_TOKEN},
     "--profile.keep"),
    (["--profile.enable", "--profile.token-file", "/nonexistent/t"], {}, "cannot read"),
])
def test_bad_profile_flags_are_one_line_config_errors(monkeypatch, argv, env, needle):
    monkeypatch.delenv("GPUSCOPE_PROFILE_TOKEN", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=needle):
        load_config(argv)


def test_caps_keep_kernels_first_and_bytes_bound_the_file():
    meta = pt.names(0, "p", [(1, "t")])
    cpu = [pt.complete(f"op{i}", "cpu_op", i, 1, 1) for i in range(50)]
    kernels = [pt.complete(f"k{i}", "kernel", 100 + i, 1, 7) for i in range(10)]
    kept, left = pt.cap_events(meta + cpu + kernels, 22)
    assert left == 60 - 20 and kept[:2] == meta
    assert sum(e.get("cat") == "kernel" for e in kept) == 10  # every kernel, then the earliest CPU ops
    assert [e["ts"] for e in kept[2:]] == sorted(e["ts"] for e in kept[2:])
    body, dropped = pt.encode({"traceEvents": meta + cpu}, 2000)
    assert len(body) <= 2000 and dropped > 0
    assert json.loads(body)["otherData"]["events_left_out_bytes"] == dropped


def test_kernel_mode_plumbing_with_torch_profiler_on_cpu(serve, monkeypatch):
    """The kernels recorder end to end where torch.profiler records CPU activity only (no CUDA here):
    module ranges and step marks land in torch's own Chrome trace, which is capped and served."""
    from gpuscope.server.profile import capture as profile

    monkeypatch.setattr(profile, "kernels_available", lambda device: True)
    server = serve(timing="budget")
    with Load(server.url):
        started = capture(server, steps=3)
        assert started["mode"] == "kernels"
        status = finished(server, started["id"])
    assert status["outcome"] == "ok", status
    trace = requests.get(server.url + started["trace_path"], headers=AUTH, timeout=10).json()
    names = {e.get("name") for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"blocks.0.attn", "blocks.0.mlp"} <= names, sorted(names)[:20]
    assert any(str(n).startswith("ProfilerStep#") for n in names)
    assert trace["otherData"]["mode"] == "kernels" and trace["otherData"]["steps_captured"] == 3
    assert server.metric(c.PROFILE_CAPTURES.name, {"mode": "kernels", "outcome": "ok"}) == 1
    # The timer's sampling of the model resumed after the window.
    assert server.service.instrumentation._model.__dict__.get("forward") is not None


class FakeBusy:
    """The kernel busy window as a capture sees it: whether CUPTI is its now, and its tracer."""

    def __init__(self) -> None:
        self.tracing = True
        self.trace = self
        self.reclaimed = 0

    def reclaim(self) -> None:
        self.reclaimed += 1


def test_kernel_capture_waits_for_an_open_busy_window_and_gives_cupti_back(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from gpuscope.server.profile import capture as profile

    monkeypatch.setattr(profile, "kernels_available", lambda device: True)
    busy = FakeBusy()
    timer = SimpleNamespace(core=SimpleNamespace(busy=busy))
    registry = CollectorRegistry()
    capture_ = profile.ProfileCapture(profile_config(tmp_path), registry, timer=timer, instrumentation=None,
                                      device="cpu")
    cap = capture_.request({"steps": 2})
    for _ in range(3):  # the engine's iterations while the busy window holds CUPTI
        capture_.tick()
        assert cap.state == "pending"
    busy.tracing = False
    capture_.tick()
    assert cap.state == "capturing"
    capture_.after_step("decode", 4, 0.01)
    capture_.after_step("decode", 4, 0.01)
    assert busy.reclaimed == 1  # handed back as the recorder stopped, on the engine thread
    wait_for(lambda: cap.state == "done", timeout=30, what="the trace written")
    assert cap.outcome == "ok" and cap.steps_captured == 2, cap.public()
    assert registry.get_sample_value(c.PROFILE_CAPTURES.name, {"mode": "kernels", "outcome": "ok"}) == 1
