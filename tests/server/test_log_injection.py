"""Client-controlled text reaches the server's logs only escaped, bounded and as a structured line.

With tracing on, an invalid ``tracestate`` used to reach stderr raw (OpenTelemetry's parser logged
it through a logger nobody configured: up to 8 kB a request, no time or level). Now it is dropped
whole, counted, and logged (at debug) only escaped and cut short; every stderr line keeps the
server's format.
"""

from __future__ import annotations

import re
import uuid

import pytest
import requests

from gpuscope.server.otlp_sink import OtlpSink
from gpuscope.server.tracestate import valid_tracestate
from gpuscope.util import logsafe
from tests.conftest import wait_for
from tests.server.test_http_hardening import ServeProcess

#: The server's stderr format: time, level, logger, message (main.setup_logging).
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+ ")


@pytest.mark.parametrize("header", ["", "congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
                                    " a=1 ,, b=2 ", "tenant@system=x", "a=" + "v" * 256, "a=1\t,b=2",
                                    ",".join(f"k{i}=v" for i in range(32))])
def test_valid_tracestates(header):
    assert valid_tracestate(header)


@pytest.mark.parametrize("header", ["garbage", "A=1", "a=1,a=2", "a=", "a=x\x7f", "a=" + "v" * 257,
                                    "a=b=c", "1a=x", ",".join(f"k{i}=v" for i in range(33)),
                                    "a=" + "\x1b[2J", "a=1," + "x" * 9000, "a=\u00e9"])
def test_invalid_tracestates(header):
    assert not valid_tracestate(header)


def test_quote_escapes_and_bounds_client_text():
    assert logsafe.quote("ok") == "'ok'"
    assert logsafe.quote("a\nb\r\x1b[31m\u2028") == "'a\\nb\\r\\x1b[31m\\u2028'"
    long = logsafe.quote("x" * 8192, 64)
    assert long == "'" + "x" * 64 + "…' (8192 chars)"


def test_escaping_filter_makes_every_record_one_line():
    import logging

    record = logging.LogRecord("gpuscope.server", logging.INFO, __file__, 1, "got %s", ("a\nFAKE ERROR",),
                               None)
    try:
        raise ValueError("boom\nline two")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    assert logsafe.EscapingFilter().filter(record)
    message = record.getMessage()
    assert "\n" not in message and message.startswith("got a\\nFAKE ERROR\\nTraceback")
    assert record.exc_info is None and record.args is None


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    sink = OtlpSink()
    server = ServeProcess(tmp_path_factory.mktemp("traced") / "serve.log", "--tracing.endpoint", sink.url,
                          "--log.level", "debug")
    yield server
    server.stop()
    sink.stop()


def test_invalid_tracestate_is_dropped_counted_and_never_logged_raw(traced):
    marker = uuid.uuid4().hex
    # 8 kB of junk a client controls (an upper-case key is invalid), with a forged log line in it.
    junk = f"X{marker}=v 2026-01-01 00:00:00,000 ERROR gpuscope.server forged " + "j" * 8000
    trace_id = uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-{'2' * 16}-01", "tracestate": junk}
    r = requests.post(traced.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers,
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["X-Trace-Id"] == trace_id  # the valid traceparent is still the parent
    wait_for(lambda: traced.metric("gpuscope_trace_context_ignored_total", header="tracestate") == 1,
             timeout=30, what="the invalid tracestate counted")
    log = traced.synced_log()
    assert "j" * 100 not in log, "the client's tracestate reached stderr raw"
    mentions = [line for line in log.splitlines() if marker in line]
    assert len(mentions) == 1 and " DEBUG gpuscope.server.tracing ignoring an invalid tracestate header: " \
        in mentions[0] and mentions[0].endswith(f"({len(junk)} chars)"), mentions
    assert len(mentions[0]) < 400
    assert all(LINE.match(line) for line in log.splitlines() if line), \
        [line for line in log.splitlines() if line and not LINE.match(line)][:3]


def test_invalid_traceparent_starts_a_new_trace_and_is_counted(traced):
    before = traced.metric("gpuscope_trace_context_ignored_total", header="traceparent")
    r = requests.post(traced.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers={"traceparent": "00-" + "z" * 32 + "-" + "1" * 16 + "-01"}, timeout=60)
    assert r.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Trace-Id"])
    ignored = "gpuscope_trace_context_ignored_total"
    wait_for(lambda: traced.metric(ignored, header="traceparent") == before + 1, timeout=30,
             what="the invalid traceparent counted")
