"""The HTTP API against a real in-process server: completions, streaming, tenants, tracing, metrics."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from gpuscope.contract import catalogue as c
from tests.conftest import promtool_check_metrics, wait_for
from tests.server.conftest import ServerThread, small_config


def sse_events(response: requests.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events


def test_completion_returns_text_usage_and_trace_headers(server):
    r = server.complete("The capital of", max_tokens=7)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "gpuscope-tiny"
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["text"], str)
    # BOS + 14 bytes of prompt; 7 generated unless the model produced EOS first.
    assert body["usage"]["prompt_tokens"] == 15
    assert body["usage"]["completion_tokens"] == (7 if choice["finish_reason"] == "length" else
                                                  body["usage"]["completion_tokens"])
    assert body["usage"]["total_tokens"] == 15 + body["usage"]["completion_tokens"]
    trace_id = r.headers["X-Trace-Id"]
    assert len(trace_id) == 32 and r.headers["traceparent"].startswith(f"00-{trace_id}-")


def test_greedy_completion_is_deterministic(server):
    texts = {server.complete("same prompt", max_tokens=12).json()["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 1


def test_traceparent_is_honoured_and_invalid_one_replaced(server):
    tid = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = requests.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
        headers={"traceparent": f"00-{tid}-00f067aa0ba902b7-01"}, timeout=30)
    assert r.headers["X-Trace-Id"] == tid
    parent = r.headers["traceparent"].split("-")
    assert parent[1] == tid and parent[2] != "00f067aa0ba902b7"
    bad = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                        headers={"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, timeout=30)
    assert bad.status_code == 200 and bad.headers["X-Trace-Id"] != "0" * 32


def test_stream_sends_chunks_then_done(server):
    r = requests.post(server.url + "/v1/completions", stream=True, timeout=30,
                      json={"prompt": "stream me", "max_tokens": 10, "stream": True, "temperature": 0})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
    streamed = "".join(ch["choices"][0]["text"] for ch in chunks)
    whole = server.complete("stream me", max_tokens=10).json()["choices"][0]["text"]
    assert streamed == whole
    assert chunks[-1]["usage"]["completion_tokens"] == server.complete(
        "stream me", max_tokens=10).json()["usage"]["completion_tokens"]


def test_tenants_default_known_and_unknown(server):
    before = server.metric("gpuscope_requests_total", {"tenant": "alpha", "outcome": "length"}) or 0
    assert server.complete("a", max_tokens=2).status_code == 200  # no header: default tenant alpha
    assert server.complete("a", max_tokens=2, tenant="beta").status_code == 200
    wait_for(lambda: server.metric("gpuscope_requests_total", {"tenant": "alpha", "outcome": "length"})
             == before + 1, what="alpha's request counted")
    r = server.complete("a", max_tokens=2, tenant="mallory")
    assert r.status_code == 400
    assert "unknown tenant 'mallory'" in r.json()["error"]["message"]


def test_unknown_tenant_maps_to_other_when_configured():
    srv = ServerThread(small_config(unknown_tenant="other", tenants=(
        small_config().tenants[0].__class__("alpha", 0.6, "high"),
        small_config().tenants[0].__class__("other", 0.4, "low")))).start()
    try:
        assert srv.complete("a", max_tokens=2, tenant="mallory").status_code == 200
        wait_for(lambda: srv.metric("gpuscope_requests_total", {"tenant": "other", "outcome": "length"}) == 1,
                 what="request counted under other")
    finally:
        srv.stop()


def test_models_health_ready(server):
    models = requests.get(server.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "gpuscope-tiny" and models["data"][0]["max_model_len"] == 256
    assert requests.get(server.url + "/healthz", timeout=5).json() == {"status": "ok"}
    assert requests.get(server.url + "/readyz", timeout=5).status_code == 200


def test_metrics_text_passes_promtool_and_has_every_server_metric(server):
    server.complete("metrics please", max_tokens=4)
    text = requests.get(server.url + "/metrics", timeout=5).text
    promtool_check_metrics(text)
    for metric in c.all_metrics():
        if metric.area == c.SERVER:
            assert f"# TYPE {metric.name} " in text, metric.name
    # The timer's per-module breakdown and the step regions are live.
    for op in ("embed", "blocks.0.attn", "blocks.0.mlp", "lm_head", "prefill", "decode"):
        assert f'op="{op}"' in text, op
    assert 'gpuscope_tenant_share_quota_ratio{tenant="alpha"} 0.7' in text


def test_metrics_openmetrics_carries_trace_id_exemplars(server):
    r = server.complete("exemplar", max_tokens=3)
    tid = r.headers["X-Trace-Id"]
    om = requests.get(server.url + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=5)
    assert om.headers["Content-Type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    lines = [ln for ln in om.text.splitlines()
             if ln.startswith("gpuscope_request_e2e_seconds_bucket") and "trace_id=" in ln]
    assert lines, "no exemplar on the e2e histogram"
    assert any(f'trace_id="{tid}"' in ln for ln in om.text.splitlines()
               if ln.startswith(("gpuscope_request_", "gpuscope_region_gpu_seconds")))


def test_metrics_openmetrics_passes_a_strict_openmetrics_parser(server):
    """promtool check metrics (2.42) parses the Prometheus text format only (exemplars, `_total` after
    `# TYPE x counter` are OpenMetrics syntax it rejects): the OpenMetrics answer goes through
    prometheus_client's OpenMetrics parser, which is strict; the text answer through promtool above."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    tid = server.complete("strict", max_tokens=3).headers["X-Trace-Id"]
    om = requests.get(server.url + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=5)
    families = {f.name: f for f in text_string_to_metric_families(om.text)}
    for metric in c.all_metrics():
        if metric.area == c.SERVER:
            assert metric.base_name in families, metric.name
            assert families[metric.base_name].type == metric.type, metric.name
    exemplars = [s.exemplar for s in families[c.REQUEST_E2E.name].samples if s.exemplar is not None]
    assert any(e.labels == {"trace_id": tid} for e in exemplars), exemplars


def test_request_metrics_count_tokens(server):
    labels = {"tenant": "beta"}
    prompt_before = server.metric("gpuscope_prompt_tokens_total", labels) or 0
    gen_before = server.metric("gpuscope_generation_tokens_total", labels) or 0
    ttft_before = server.metric("gpuscope_request_ttft_seconds_count", labels) or 0
    body = server.complete("12345", max_tokens=5, tenant="beta").json()
    wait_for(lambda: server.metric("gpuscope_request_ttft_seconds_count", labels) == ttft_before + 1)
    assert server.metric("gpuscope_prompt_tokens_total", labels) == prompt_before + 6
    assert server.metric("gpuscope_generation_tokens_total", labels) == gen_before + \
        body["usage"]["completion_tokens"]
    assert server.metric("gpuscope_tenant_gpu_seconds_total", labels) > 0


def test_client_disconnect_mid_stream_aborts_and_frees_the_slot(server):
    before = server.metric("gpuscope_requests_total", {"tenant": "alpha", "outcome": "abort"}) or 0
    disconnects = server.metric(c.HTTP_CLIENT_ERRORS.name, {"reason": "disconnect"})
    payload = json.dumps({"prompt": "bye", "max_tokens": 64, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        assert b"200 OK" in sock.recv(4096)
    wait_for(lambda: server.metric("gpuscope_requests_total", {"tenant": "alpha", "outcome": "abort"})
             == before + 1, what="aborted request counted")
    wait_for(lambda: server.metric("gpuscope_requests_running", {"tenant": "alpha"}) == 0,
             what="slot freed")
    assert server.complete("still fine", max_tokens=2).status_code == 200
    assert server.metric(c.HTTP_CLIENT_ERRORS.name, {"reason": "disconnect"}) == disconnects + 1


def test_full_queue_answers_429_with_retry_after():
    srv = ServerThread(small_config(max_queue_per_tenant=1, max_batch_size=1)).start()
    try:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(srv.complete, "flood", 48) for _ in range(8)]
            statuses = [f.result() for f in futures]
        rejected = [r for r in statuses if r.status_code == 429]
        assert rejected, [r.status_code for r in statuses]
        assert all(r.status_code in (200, 429) for r in statuses)
        assert int(rejected[0].headers["Retry-After"]) >= 1
        assert "queue of tenant 'alpha' is full" in rejected[0].json()["error"]["message"]
        counted = srv.metric("gpuscope_requests_total", {"tenant": "alpha", "outcome": "rejected"})
        assert counted == len(rejected)
    finally:
        srv.stop()


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"max_tokens": 3}', 400, "missing required field 'prompt'"),
    (b'{"prompt": 3}', 400, "'prompt' must be a string"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "'max_tokens' must be between 1 and 64"),
    (b'{"prompt": "x", "max_tokens": 65}', 400, "'max_tokens' must be between 1 and 64"),
    (b'{"prompt": "x", "max_tokens": "5"}', 400, "'max_tokens' must be an integer"),
    (b'{"prompt": "x", "max_tokens": true}', 400, "'max_tokens' must be an integer"),
    (b'{"prompt": "x", "temperature": -1}', 400, "'temperature'"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "'temperature'"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "'stream'"),
    (b'{"prompt": "' + b"x" * 250 + b'", "max_tokens": 10}', 400, "exceed the model's context of 256"),
    (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "larger than 4096 bytes"),
    (b"[" * 2000 + b"]" * 2000, 400, "not valid JSON"),
])
def test_bad_input_gets_4xx_json_naming_the_problem(server, body, status, words):
    r = requests.post(server.url + "/v1/completions", data=body, timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert r.headers.get("X-Trace-Id")


def test_unknown_route_and_method_are_json(server):
    assert requests.get(server.url + "/nope", timeout=5).json()["error"]["code"] == 404
    r = requests.delete(server.url + "/v1/completions", timeout=5)
    assert r.status_code == 405 and "POST" in r.headers["Allow"] and r.json()["error"]["code"] == 405
