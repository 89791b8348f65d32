"""``gpuscope serve`` as a process: flags, one-line errors, and request logs reaching Loki."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from gpuscope.loadtest.serverproc import ServerProcess
from tests.conftest import selected, side_by_side, usage_error, usage_line, wait_for
from tests.logs.test_loki_push import Receiver

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
SMALL = ["--model.layers", "1", "--model.dim", "64", "--model.context", "256", "--request.max-tokens", "32"]


def serve(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuscope", "serve", *args], capture_output=True, text=True,
                          timeout=60, env=env or ENV, **kw)


def _serve_usage(args: tuple[str, ...]) -> subprocess.CompletedProcess | subprocess.TimeoutExpired:
    try:
        return serve(*args)
    except subprocess.TimeoutExpired as exc:
        return exc


@pytest.fixture(scope="module")
def bad_flag_runs(request) -> dict:
    """``gpuscope serve ARGS`` of every selected bad-flag case, side by side: each process loads torch
    before it parses its flags, which is most of its time."""
    return side_by_side(_serve_usage, [tuple(args) for args in
                                       selected(request, "test_bad_flags_exit_2_with_one_line", "args")])


@pytest.mark.parametrize("args, message", [
    (["--tenants", "a:0.8,b:0.8"], "shares sum to 1.6"),
    (["--tenants", "a:1", "--tenants.default", "b"], "--tenants.default 'b' is not a configured tenant"),
    (["--scheduler", "lottery"], "--scheduler: invalid choice: 'lottery' (choose from 'share', 'fcfs')"),
    (["--timing", "sometimes"], "--timing: invalid choice: 'sometimes' (choose from 'off', 'budget', 'all')"),
    (["--log.level", "loud"], "--log.level: invalid choice: 'loud'"),
    (["--model.dim", "100", "--model.heads", "3"], "not a multiple of --model.heads"),
    (["--web.listen-address", "nowhere"], "is not HOST:PORT"),
    (["--faults.enable"], "--faults.enable needs a token"),
    (["--faults.enable", "--faults.token-file", "/nonexistent/token"], "cannot read /nonexistent/token"),
    (["--model.checkpoint", "/nonexistent.pt"], "is not a local file"),
    (["--batch.max-size", "lots"], "invalid int value"),
    (["--model.cuda-graphs", "--model.device", "cpu"], "--model.cuda-graphs needs a CUDA device"),
    (["--model.cuda-graphs", "--model.hf", "/nonexistent"], "cannot go with --model.hf"),
    (["--timing", "off", "--timing.kernel-busy"], "--timing.kernel-busy needs the timer"),
])
def test_bad_flags_exit_2_with_one_line(args, message, bad_flag_runs):
    result = bad_flag_runs[tuple(args)]
    assert not isinstance(result, subprocess.TimeoutExpired), f"no answer in {result.timeout} s"
    assert message in usage_line(result)


def test_kernel_busy_windows_need_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the server would start")
    message = usage_error("gpuscope", "serve", *SMALL, "--timing.kernel-busy", env=ENV)
    assert "--timing.kernel-busy needs a CUDA GPU" in message


def test_env_variables_configure_flags():
    env = {**ENV, "GPUSCOPE_SCHEDULER": "lottery"}
    result = serve(env=env)
    assert result.returncode == 2 and "'lottery'" in result.stderr


@pytest.mark.slow
def test_serve_answers_and_ships_request_logs_to_loki(tmp_path):
    receiver = Receiver().start()
    token = tmp_path / "token"
    token.write_text("a-long-enough-fault-token\n")
    server = ServerProcess([*SMALL, "--tenants", "alpha:0.7:high,beta:0.3:low", "--loki.url", receiver.url,
                            "--faults.enable", "--faults.token-file", str(token)],
                           log_path=tmp_path / "serve.log", env=ENV, ready_timeout_s=60)
    url, port = server.url, server.port
    try:
        server.start()
        r = requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                          headers={"X-Tenant": "beta"}, timeout=30)
        assert r.status_code == 200
        trace_id = r.headers["X-Trace-Id"]
        auth = {"Authorization": "Bearer a-long-enough-fault-token"}
        assert requests.post(url + "/admin/faults/latency_spike", json={"duration_s": 5}, headers=auth,
                             timeout=5).status_code == 200

        def request_line():
            for labels, (_, line, meta) in receiver.entries:
                if meta.get("trace_id") == trace_id:
                    return labels, json.loads(line), meta
            return None

        labels, line, meta = wait_for(request_line, timeout=15, what="request log line in Loki")
        assert labels == {"service": "gpuscope-server", "instance": f"{labels['instance']}"}
        assert labels["instance"].endswith(f":{port}")
        assert meta == {"level": "info", "trace_id": trace_id, "tenant": "beta"}
        assert line["tenant"] == "beta" and line["outcome"] in ("length", "stop")
        assert line["prompt_tokens"] == 3 and line["e2e_s"] >= line["ttft_s"] > 0
        assert receiver.invalid == []
    finally:
        try:
            server.stop()
        finally:
            receiver.stop()
    assert server.child.poll() in (0, -15)
