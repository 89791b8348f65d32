"""Request spans: structure and attributes, W3C trace context in and out, OTLP export, drops, and off.

Spans are read with the SDK's InMemorySpanExporter, and, for the wire, by a local OTLP/HTTP receiver
(gpuscope.server.otlp_sink) that decodes each POST /v1/traces with opentelemetry-proto.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests

pytest.importorskip("opentelemetry.sdk", reason="needs the tracing extra: pip install -e '.[tracing]'")

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

from gpuscope.server import tracing as t
from gpuscope.server.config import ConfigError, parse_tenants, resolve_tracing
from gpuscope.server.otlp_sink import OtlpSink
from gpuscope.server.protocol import parse_traceparent
from tests.conftest import wait_for
from tests.server.conftest import ServerThread, small_config

ROOT = Path(__file__).resolve().parents[2]
TID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


class TracedServer(ServerThread):
    """tests.server.conftest's server, with request tracing wired in as ``gpuscope serve`` does it."""

    def __init__(self, config, exporter: SpanExporter | None = None, on_step=None, **tracing_options) -> None:
        from gpuscope.server.api import build_app
        from gpuscope.server.service import Service

        self.config = config
        self.service = Service(config)
        if on_step is not None:  # an observer already there (benchmarks use one): tracing chains to it
            self.service.engine.on_step = on_step
        self.tracing = t.RequestTracing(config, self.service.registry, exporter=exporter,
                                        schedule_delay_millis=50, gpu_wait_s=60.0, **tracing_options)
        self.app = build_app(self.service, tracing=self.tracing)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="test-traced-server", daemon=True)
        self._started = threading.Event()
        self.port = 0

    def spans_of(self, exporter: InMemorySpanExporter, trace_id: str, count: int) -> dict[str, object]:
        """The finished spans of one trace by name, once ``count`` of them arrived."""

        def arrived():
            self.tracing.flush(1.0)
            spans = [s for s in exporter.get_finished_spans()
                     if format(s.context.trace_id, "032x") == trace_id]
            return spans if len(spans) >= count else None

        spans = wait_for(arrived, timeout=60, interval=0.1, what=f"{count} spans of trace {trace_id}")
        assert len(spans) == count, [s.name for s in spans]
        return {s.name: s for s in spans}

    def dropped(self, reason: str) -> float:
        return self.metric("gpuscope_trace_spans_dropped_total", {"reason": reason}) or 0.0


def traced_config(**overrides):
    return small_config(tracing_endpoint="http://127.0.0.1:9/v1/traces", tracing_source="--tracing.endpoint",
                        **overrides)


@pytest.fixture(scope="module")
def memory():
    exporter = InMemorySpanExporter()
    srv = TracedServer(traced_config(tracing_max_step_events=3), exporter).start()
    yield srv, exporter
    srv.stop()


def test_request_spans_structure_and_why_slow_attributes(memory):
    srv, exporter = memory
    r = srv.complete("why was this slow?", max_tokens=10, tenant="beta")
    assert r.status_code == 200, r.text
    trace_id = r.headers["X-Trace-Id"]
    spans = srv.spans_of(exporter, trace_id, 4)
    assert set(spans) == {"POST /v1/completions", "queue", "prefill", "decode"}
    root = spans["POST /v1/completions"]
    assert root.kind is SpanKind.SERVER and root.parent is None
    flags = int(root.context.trace_flags)
    assert r.headers["traceparent"] == f"00-{trace_id}-{root.context.span_id:016x}-{flags:02x}"
    for name in ("queue", "prefill", "decode"):
        child = spans[name]
        assert child.parent.span_id == root.context.span_id and t.TENANT not in child.attributes
    # The phases tile the request in order, inside the server span.
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert root.start_time <= queue.start_time <= queue.end_time <= prefill.start_time + 1000
    assert prefill.end_time <= decode.start_time + 1000 and decode.end_time <= root.end_time + 1000

    usage = r.json()["usage"]
    a = root.attributes
    assert a[t.TENANT] == "beta" and a[t.PRIORITY] == "low" and a[t.OUTCOME] in ("length", "stop")
    assert a["http.response.status_code"] == 200 and a["gen_ai.request.max_tokens"] == 10
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a[t.STREAM] is False and a[t.PREEMPTIONS] == 0 and a[t.STEPS] == usage["completion_tokens"]
    assert a[t.TTFT_MS] >= a[t.QUEUE_MS] >= 0 and root.status.status_code is StatusCode.UNSET
    assert spans["queue"].attributes[t.WAITING] >= 0
    # GPU seconds per request: the timer's measurement of each step it was in, shared by tokens (here
    # alone in its steps, so share = whole). On CPU the timer's clock is the host's.
    assert a[t.STEP_CLOCK] == ("cuda_events" if srv.service.device.type == "cuda" else "host")
    assert t.UNRESOLVED not in a
    assert a[t.GPU_SECONDS] > 0 and a[t.GPU_SECONDS] == pytest.approx(a[t.STEP_GPU_SECONDS])
    # Step events: at most 3 (--tracing.max-step-events), then a summary of all steps.
    events = [e for s in (prefill, decode) for e in s.events if e.name == "step"]
    assert len(events) == 3 and events[0].attributes["gpuscope.step.op"] == "prefill"
    assert all(e.attributes["gpuscope.step.rows"] >= 1 and e.attributes["gpuscope.step.gpu_ms"] >= 0
               for e in events)
    if usage["completion_tokens"] > 3:
        (summary,) = [e for e in decode.events if e.name == "steps.summary"]
        assert summary.attributes[t.STEPS] == usage["completion_tokens"]
        assert summary.attributes["gpuscope.steps.events_omitted"] == usage["completion_tokens"] - 3
    assert prefill.attributes[t.STEPS] == 1 and prefill.attributes[t.ROWS_MAX] >= 1


def test_batch_rows_are_those_of_the_steps_it_was_in():
    exporter = InMemorySpanExporter()
    seen: list[tuple[str, list[str]]] = []  # (op, trace ids of the batch), as the engine ran them

    def record(op, batch, host_s):
        seen.append((op, [r.trace_id for r in batch]))
        time.sleep(0.002)  # slow steps, so requests sent together share some

    srv = TracedServer(traced_config(), exporter, on_step=record).start()
    try:
        barrier = threading.Barrier(3)
        answers = []

        def send():
            barrier.wait()
            answers.append(srv.complete("together", max_tokens=12))

        threads = [threading.Thread(target=send) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert len(answers) == 3 and all(r.status_code == 200 for r in answers)
        for r in answers:
            trace_id = r.headers["X-Trace-Id"]
            spans = srv.spans_of(exporter, trace_id, 4)
            mine = [(op, len(ids)) for op, ids in seen if trace_id in ids]
            decode = [rows for op, rows in mine if op == "decode"]
            assert spans["POST /v1/completions"].attributes[t.STEPS] == len(mine)
            prefill_rows = next(rows for op, rows in mine if op == "prefill")
            assert spans["prefill"].attributes[t.ROWS_MAX] == prefill_rows
            a = spans["decode"].attributes
            assert a[t.STEPS] == len(decode) and a[t.ROWS_MAX] == max(decode)
            assert a[t.ROWS_MEAN] == pytest.approx(sum(decode) / len(decode), abs=0.01)
    finally:
        srv.stop()


def test_stream_span_counts_chunks(memory):
    srv, exporter = memory
    r = requests.post(srv.url + "/v1/completions", stream=True, timeout=30,
                      json={"prompt": "stream", "max_tokens": 6, "stream": True, "temperature": 0})
    lines = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    spans = srv.spans_of(exporter, r.headers["X-Trace-Id"], 5)
    stream = spans["stream"]
    assert stream.attributes[t.STREAM_CHUNKS] == len(lines) and stream.attributes[t.STREAM_WAIT] >= 0
    assert spans["POST /v1/completions"].attributes[t.STREAM] is True
    assert stream.parent.span_id == spans["POST /v1/completions"].context.span_id


def test_incoming_traceparent_is_the_parent_and_goes_back_out(memory):
    srv, exporter = memory
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30,
                      headers={"traceparent": f"00-{TID}-{PARENT}-01", "tracestate": "vendor=abc"})
    assert r.status_code == 200 and r.headers["X-Trace-Id"] == TID
    root = srv.spans_of(exporter, TID, 4)["POST /v1/completions"]
    assert root.parent.span_id == int(PARENT, 16) and root.parent.is_remote
    assert root.context.trace_state.get("vendor") == "abc"
    version, trace_id, span_id, flags = r.headers["traceparent"].split("-")
    assert (version, trace_id, int(span_id, 16)) == ("00", TID, root.context.span_id)
    assert int(flags, 16) & 1  # sampled, as the parent asked


def test_unsampled_parent_means_no_spans_but_the_same_trace_id(memory):
    srv, exporter = memory
    tid = "5bf92f3577b34da6a3ce929d0e0e4736"
    r = requests.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30,
                      headers={"traceparent": f"00-{tid}-{PARENT}-00"})
    assert r.status_code == 200 and r.headers["X-Trace-Id"] == tid
    assert r.headers["traceparent"].startswith(f"00-{tid}-")
    assert not int(r.headers["traceparent"].rsplit("-", 1)[1], 16) & 1  # not sampled, as the parent said
    srv.complete("after", max_tokens=1)  # one more request, to be sure the first had its chance
    srv.tracing.flush(5)
    assert not [s for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == tid]


@pytest.mark.parametrize("header", [
    f"00-{TID}-{PARENT}-01", f"00-{TID.upper()}-{PARENT}-01", f" 00-{TID}-{PARENT}-01 ",
    f"00-{TID}-{PARENT}-01-extra", f"01-{TID}-{PARENT}-01-future", f"ff-{TID}-{PARENT}-01",
    f"00-{'0' * 32}-{PARENT}-01", f"00-{TID}-{'0' * 16}-01", "garbage", f"00-{TID}-{PARENT}",
])
def test_traced_and_untraced_paths_accept_the_same_traceparents(memory, header):
    srv, _ = memory
    rt = srv.tracing.begin({"traceparent": header})
    expected = parse_traceparent(header)  # what the untraced path (and so the Loki line) would keep
    if expected is None:
        assert rt.trace_id != TID and rt.span.parent is None
    else:
        assert rt.trace_id == expected and rt.span.parent.span_id == int(PARENT, 16)


@pytest.mark.parametrize("header", [f"00-{TID.upper()}-{PARENT}-01", f"00-{TID}-{PARENT.upper()}-01",
                                    f"00-{TID}-{PARENT}-0A", f"0A-{TID}-{PARENT}-01"])
def test_uppercase_hex_in_a_traceparent_is_invalid(memory, header):
    """W3C Trace Context: lowercase hex only; an uppercase header starts a new trace."""
    assert parse_traceparent(header) is None
    srv, _ = memory
    rt = srv.tracing.begin({"traceparent": header})
    assert rt.trace_id != TID.lower() and rt.span.parent is None


def test_span_trace_id_is_the_loki_line_and_exemplar_trace_id(memory):
    srv, exporter = memory
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    logger = logging.getLogger("gpuscope.server.requests")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        r = srv.complete("exemplar", max_tokens=2, tenant="beta")
        trace_id = r.headers["X-Trace-Id"]
        spans = srv.spans_of(exporter, trace_id, 4)
        line = wait_for(lambda: next((json.loads(rec.getMessage()) for rec in records
                                      if getattr(rec, "trace_id", None) == trace_id), None), what="log line")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert line["trace_id"] == trace_id == format(spans["queue"].context.trace_id, "032x")
    exposition = openmetrics(srv.service.registry).decode()
    assert f'trace_id="{trace_id}"' in exposition  # the exemplar of its latency observations


def test_preempted_request_shows_its_preemption():
    """The preemption is forced, not hoped for: the high-priority request is sent once the
    low-priority one has had its first step, and from its second step on the low-priority request
    waits until the high-priority one is queued (on a busy machine it could otherwise finish first).
    It cannot end early either: greedy, past end-of-sequence tokens (the toy model samples one in 258
    at temperature 1, which would free the slot instead of preempting)."""
    exporter = InMemorySpanExporter()
    lo_steps, holder, started = [0], {}, threading.Event()

    def gate(op, batch, host_s):
        if not any(r.tenant == "lo" for r in batch):
            return
        lo_steps[0] += 1
        if lo_steps[0] == 1:  # lo's prefill: lo is running, the test may send hi
            started.set()
            return
        scheduler = holder["srv"].service.scheduler
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # polled: the engine thread has nothing to wait on
            state = scheduler.state()
            if state["lo"].preemptions or state["hi"].queued or state["hi"].running:
                return
            time.sleep(0.002)

    config = traced_config(max_batch_size=1, tenants=parse_tenants("hi:0.5:high,lo:0.5:low"),
                           default_tenant="lo")
    srv = holder["srv"] = TracedServer(config, exporter, on_step=gate).start()
    try:
        # Its headers come at once; its first text may not (a token can be half a UTF-8 character).
        low = requests.post(srv.url + "/v1/completions", stream=True, timeout=60, headers={"X-Tenant": "lo"},
                            json={"prompt": "long", "max_tokens": 64, "stream": True, "temperature": 0,
                                  "ignore_eos": True})
        assert started.wait(60), "lo never started"
        high = srv.complete("urgent", max_tokens=2, tenant="hi")
        assert high.status_code == 200
        rest = [line for line in low.iter_lines() if line.startswith(b"data: ")]
        assert rest[-1] == b"data: [DONE]"
        assert srv.service.scheduler.state()["lo"].preemptions >= 1, "the scenario did not preempt"
        spans = srv.spans_of(exporter, low.headers["X-Trace-Id"], 5)
        assert spans["POST /v1/completions"].attributes[t.PREEMPTIONS] >= 1
        resumed = [e for e in spans["decode"].events if e.name == "resumed"]
        assert resumed and resumed[0].attributes["gpuscope.preempted_ms"] >= 0
    finally:
        srv.stop()


def test_errors_mark_the_span_and_a_failing_tracer_never_fails_a_request():
    exporter = InMemorySpanExporter()
    srv = TracedServer(traced_config(), exporter).start()
    try:
        bad = requests.post(srv.url + "/v1/completions", data=b"{nope", timeout=30)
        assert bad.status_code == 400
        (root,) = srv.spans_of(exporter, bad.headers["X-Trace-Id"], 1).values()
        assert root.attributes[t.OUTCOME] == "invalid" and root.status.status_code is StatusCode.UNSET

        def broken(op, batch, host_s):
            raise RuntimeError("tracing bug")

        srv.tracing._record_step = broken
        r = srv.complete("still served", max_tokens=3)
        assert r.status_code == 200
    finally:
        srv.stop()


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None
    return out


def test_spans_arrive_over_otlp_http_with_trace_id_and_attributes():
    receiver = OtlpSink()
    config = replace(traced_config(), tracing_endpoint=receiver.url + "/v1/traces", instance="test:1")
    srv = TracedServer(config).start()  # the real OTLP/HTTP exporter
    try:
        r = srv.complete("over the wire", max_tokens=4, tenant="beta")
        trace_id = bytes.fromhex(r.headers["X-Trace-Id"])

        def arrived():
            return [(res, s) for res, s in receiver.spans() if s.trace_id == trace_id]

        got = wait_for(lambda: len(arrived()) >= 4 and arrived(), timeout=60, interval=0.1, what="OTLP spans")
        names = {s.name for _, s in got}
        assert names == {"POST /v1/completions", "queue", "prefill", "decode"}
        resource, root = next((res, s) for res, s in got if s.name == "POST /v1/completions")
        assert resource["service.name"] == t.SERVICE_NAME and resource["service.instance.id"] == "test:1"
        attributes = _attributes(root)
        assert attributes[t.TENANT] == "beta" and attributes[t.OUTCOME] in ("length", "stop")
        assert attributes["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
        assert r.headers["traceparent"].split("-")[2] == root.span_id.hex()
        for _, span in got:
            assert span.name == root.name or span.parent_span_id == root.span_id
        wait_for(lambda: (srv.metric("gpuscope_trace_spans_exported_total") or 0) >= 4, what="export counted")
    finally:
        srv.stop()
        receiver.stop()


def test_rejected_export_is_counted_and_costs_the_request_nothing():
    receiver = OtlpSink()
    receiver.status = 400  # not retryable: the batch is dropped at once
    config = replace(traced_config(), tracing_endpoint=receiver.url + "/v1/traces")
    srv = TracedServer(config).start()
    try:
        for _ in range(3):
            assert srv.complete("refused", max_tokens=2).status_code == 200
        wait_for(lambda: srv.dropped("export_failed") >= 12, timeout=60, what="failed exports counted")
        assert not srv.metric("gpuscope_trace_spans_exported_total")
    finally:
        srv.stop()
        receiver.stop()


class BlockedExporter(SpanExporter):
    """An endpoint that hangs until released, counting what it finally gets."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.spans = 0

    def export(self, spans):
        self.release.wait(60)
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


def test_full_export_queue_drops_whole_traces_without_blocking_requests():
    exporter = BlockedExporter()
    srv = TracedServer(traced_config(), exporter, max_queue_size=6, max_export_batch_size=2).start()
    try:
        answers = [srv.complete("queued", max_tokens=2) for _ in range(6)]  # 4 spans each; the exporter hangs
        assert all(r.status_code == 200 for r in answers)
        wait_for(lambda: srv.dropped("queue_full") > 0, timeout=60, what="queue_full drops")
        assert srv.dropped("queue_full") % 4 == 0  # whole traces only
        exporter.release.set()
        srv.tracing.flush(30)
        wait_for(lambda: exporter.spans + srv.dropped("queue_full") == 6 * 4, timeout=60,
                 what="every span exported or counted as dropped")
    finally:
        exporter.release.set()
        srv.stop()


def test_full_backlog_drops_and_counts():
    exporter = InMemorySpanExporter()
    srv = TracedServer(traced_config(), exporter, backlog=0).start()
    try:
        assert srv.complete("no room", max_tokens=2).status_code == 200
        assert srv.dropped("backlog_full") == 4
        assert not exporter.get_finished_spans()
    finally:
        srv.stop()


def test_ratio_zero_traces_nothing_but_keeps_trace_ids():
    exporter = InMemorySpanExporter()
    srv = TracedServer(traced_config(tracing_sample_ratio=0.0), exporter).start()
    try:
        r = srv.complete("unsampled", max_tokens=2)
        assert r.status_code == 200 and len(r.headers["X-Trace-Id"]) == 32
        assert not int(r.headers["traceparent"].rsplit("-", 1)[1], 16) & 1  # not sampled
        # A sampled parent still gets its spans (parent-based).
        sampled = requests.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                timeout=30, headers={"traceparent": f"00-{TID}-{PARENT}-01"})
        srv.spans_of(exporter, TID, 4)
        assert not [s for s in exporter.get_finished_spans()
                    if format(s.context.trace_id, "032x") == r.headers["X-Trace-Id"]]
        assert sampled.status_code == 200
    finally:
        srv.stop()


def test_shutdown_detaches_from_the_engine_and_stops_its_thread():
    srv = TracedServer(traced_config(), InMemorySpanExporter()).start()
    engine = srv.service.engine
    assert engine.on_step is not None and isinstance(engine.timer, t._StepTimer)
    srv.stop()
    assert not srv.tracing._builder.is_alive()
    assert engine.on_step is None and not isinstance(engine.timer, t._StepTimer)


OFF = r"""
import asyncio, sys, urllib.request
from aiohttp import web
from gpuscope.server.api import build_app
from gpuscope.server.service import Service
from tests.server.conftest import small_config

service = Service(small_config())
timer = service.engine.timer
app = build_app(service)

async def main():
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    def ask():
        body = b'{"prompt": "off", "max_tokens": 2}'
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                                           data=body), timeout=120) as r:
            return r.status, dict(r.headers)
    status, headers = await asyncio.get_running_loop().run_in_executor(None, ask)
    await runner.cleanup()
    return status, headers

status, headers = asyncio.run(main())
assert status == 200, status
assert headers["traceparent"].startswith("00-" + headers["X-Trace-Id"]), headers
assert service.engine.on_step is None and service.engine.timer is timer
assert not any(m.name.startswith("gpuscope_trace") for m in service.registry.collect())
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("off: ok")
"""


def test_tracing_off_imports_nothing_and_hooks_nothing():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for name in [k for k in env if k.startswith("OTEL_")]:
        del env[name]
    result = subprocess.run([sys.executable, "-c", OFF], capture_output=True, text=True, timeout=300,
                            env=env, cwd=ROOT)
    assert result.returncode == 0 and "off: ok" in result.stdout, result.stderr[-3000:]


# --- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, env, expected", [
    (None, {}, (None, "")),
    ("http://c:4318", {}, ("http://c:4318/v1/traces", "--tracing.endpoint")),
    ("http://c:4318/v1/traces", {"OTEL_SDK_DISABLED": "true"},
     ("http://c:4318/v1/traces", "--tracing.endpoint")),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"},
     ("http://c:4318/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT")),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"},
     ("http://t/x", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "TRUE"},
     (None, "OTEL_SDK_DISABLED")),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"},
     (None, "OTEL_TRACES_EXPORTER")),
    (None, {"OTEL_TRACES_EXPORTER": "otlp"}, (None, "")),
])
def test_endpoint_from_flag_or_otel_environment(flag, env, expected):
    assert resolve_tracing(flag, env) == expected


@pytest.mark.parametrize("flag, env, message", [
    ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTLP over HTTP"),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "zipkin"},
     "otlp or none"),
])
def test_unsupported_otel_settings_are_one_line_errors(flag, env, message):
    with pytest.raises(ConfigError, match=message):
        resolve_tracing(flag, env)


def test_ttft_ms_rounds_up_so_the_policy_threshold_is_exact():
    assert t._ms(1.0) == 1000 and t._ms(1.0004) == 1001 and t._ms(0.0) == 0 and t._ms(0.9991) == 1000


def serve(*args: str, env: dict | None = None, code: str = "") -> subprocess.CompletedProcess:
    base = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    prelude = code + "import sys; from gpuscope.cli import main; sys.exit(main(['serve', *sys.argv[1:]]))"
    return subprocess.run([sys.executable, "-c", prelude, *args], capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})})


@pytest.mark.parametrize("args, message", [
    (["--tracing.sample-ratio", "2"], "--tracing.sample-ratio must be between 0 and 1"),
    (["--tracing.endpoint", "collector:4318"], "is not an http(s) URL"),
    (["--tracing.max-step-events", "1000"], "--tracing.max-step-events must be between 0 and 100"),
])
def test_bad_tracing_flags_exit_2_with_one_line(args, message):
    result = serve(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


BLOCK_OTEL = "import sys; sys.modules['opentelemetry'] = None\n"


def test_missing_opentelemetry_is_fatal_for_the_flag_and_a_warning_for_the_environment():
    result = serve("--tracing.endpoint", "http://127.0.0.1:9", code=BLOCK_OTEL)
    assert result.returncode == 2 and "pip install 'gpuscope[tracing]'" in result.stderr, result.stderr
    # From the environment, it serves without spans: here it gets as far as listening on a busy port.
    with __import__("socket").socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = serve("--model.layers", "1", "--model.dim", "64",
                       "--web.listen-address", f"127.0.0.1:{port}",
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, code=BLOCK_OTEL)
    assert result.returncode == 1 and "cannot listen" in result.stderr, result.stderr
    assert "serving without spans" in result.stderr


# --- the benchmark -------------------------------------------------------------------------------------

BENCH = ROOT / "benchmarks" / "tracing_bench.py"


def test_benchmark_quick_run_measures_both_parts(tmp_path):
    out = tmp_path / "tracing.json"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]["summary"]
    assert parts["loop_us_per_request.on"]["median"] > 0 and parts["builder_us_per_request"]["median"] >= 0
    served = report["served"]
    assert served["errors"] == 0 and len(served["pairs"]) == 2
    # Every traced request's four spans reached the receiver, none dropped.
    assert served["spans_received_total"] == served["spans_exported_total"] > 0
    assert served["spans_dropped_total"] == 0


def test_benchmark_says_what_is_missing_without_opentelemetry(tmp_path):
    code = (BLOCK_OTEL + "import runpy; sys.argv = ['tracing_bench.py', '--out', sys.argv[1]]; "
            f"runpy.run_path({str(BENCH)!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.json")], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "opentelemetry-sdk" in result.stderr and "pip install" in result.stderr
