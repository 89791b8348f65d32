"""With request tracing on, a chat completion gets the same spans as a completion, under its own route."""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("opentelemetry.sdk", reason="needs the tracing extra: pip install -e '.[tracing]'")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpuscope.server import tracing as t
from tests.server.test_tracing import TracedServer, traced_config


def test_chat_request_spans_name_the_chat_route():
    exporter = InMemorySpanExporter()
    srv = TracedServer(traced_config(), exporter).start()
    try:
        body = {"messages": [{"role": "user", "content": "trace me"}], "max_tokens": 5, "temperature": 0,
                "stream": True}
        r = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=30, stream=True)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        spans = srv.spans_of(exporter, r.headers["X-Trace-Id"], 5)
        assert set(spans) == {"POST /v1/chat/completions", "queue", "prefill", "decode", "stream"}
        root = spans["POST /v1/chat/completions"].attributes
        assert root["http.route"] == "/v1/chat/completions" and root["gen_ai.operation.name"] == "chat"
        assert root[t.STREAM] is True and root[t.TTFT_MS] >= 0
        plain = requests.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        names = set(srv.spans_of(exporter, plain.headers["X-Trace-Id"], 4))
        assert "POST /v1/completions" in names
    finally:
        srv.stop()
