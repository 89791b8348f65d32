"""Exact percentiles and rates, the recorder's worker → master hand-off, and SSE parsing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuscope.loadtest.recorder import Recorder, load_samples
from gpuscope.loadtest.sse import DONE, Chunk, StreamError, StreamTiming, parse_sse_line
from gpuscope.loadtest.stats import percentile, summarise


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)


def test_percentile_of_nothing_is_none_and_q_is_checked():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _request(t, tenant="a", ok=True, ttft=0.1, e2e=1.0, tokens=10, itl=(0.05, 0.07)):
    return {"t": t, "tenant": tenant, "ok": ok, "ttft": ttft, "e2e": e2e, "tokens": tokens,
            "itl": list(itl), "error": None if ok else "HTTP 503"}


def test_summary_counts_only_the_window_and_divides_by_its_length():
    requests = [_request(5.0), _request(10.0), _request(11.0, ttft=0.3), _request(12.0, ok=False),
                _request(30.0)]
    s = summarise(requests, 10.0, 20.0)
    assert s.requests == 3 and s.errors == 1
    assert s.error_rate == pytest.approx(1 / 3)
    assert s.rps == pytest.approx(2 / 10) and s.tps == pytest.approx(20 / 10)
    assert s.ttft_p50_s == pytest.approx(0.2)
    assert s.itl_p50_s == pytest.approx(0.06) and s.itl_p99_s == pytest.approx(0.07)


def test_long_requests_count_where_they_finish_and_tokens_where_they_arrive():
    # Sent during warm-up (t=8), first token at 9, gaps of 1 s: chunks at 9, 10, 11; done at 11.5.
    straddling = _request(8.0, ttft=1.0, e2e=3.5, tokens=6, itl=(1.0, 1.0))
    # Cut off by the end of the run: two chunks (12, 13) received, never finished.
    cut = {**_request(11.0, ttft=1.0, e2e=None, tokens=2, itl=(1.0,)), "cut": True}
    s = summarise([straddling, cut], 10.0, 20.0)
    assert s.requests == 1 and s.errors == 0 and s.e2e_p50_s == 3.5
    assert s.tps == pytest.approx((4 + 2) / 10)  # 2 of 3 chunks × 2 tokens each, plus the cut one's 2
    assert s.ttft_p50_s == 1.0  # only the cut request's first token arrived inside
    assert s.itl_p50_s == 1.0


def test_summary_per_tenant_and_empty_window():
    requests = [_request(1.0, "a"), _request(1.5, "b", tokens=4)]
    assert summarise(requests, 0, 2, tenant="b").tps == pytest.approx(2.0)
    empty = summarise(requests, 5, 6)
    assert empty.requests == 0 and empty.ttft_p99_s is None and empty.error_rate == 0
    with pytest.raises(ValueError):
        summarise(requests, 3, 3)


def test_worker_batches_reach_the_master_once_each():
    worker, master = Recorder(), Recorder()
    worker.reset(0.0)
    master.reset(0.0)
    worker.add(1.0, "a", True, 0.1, 0.5, 3, [0.1, 0.2])
    master.merge(worker.take_unshipped())
    worker.add(2.0, "a", False, None, 0.2, 0, [], "HTTP 500")
    master.merge(worker.take_unshipped())
    master.merge(worker.take_unshipped())  # nothing new: a report between requests
    assert [r["t"] for r in master.requests] == [1.0, 2.0]


def test_recorder_caps_memory_and_counts_what_it_dropped(tmp_path):
    recorder = Recorder(max_requests=2)
    recorder.reset(100.0)
    for i in range(5):
        recorder.add(100.0 + i, "a", True, 0.1, 0.2, 1, [])
    recorder.stopped = 110.0
    recorder.write(tmp_path / "s.json")
    data = load_samples(tmp_path / "s.json")
    assert len(data["requests"]) == 2 and data["dropped"] == 3
    assert data["started"] == 100.0 and data["stopped"] == 110.0


def test_load_samples_rejects_other_files(tmp_path):
    (tmp_path / "x.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a gpuscope samples file"):
        load_samples(tmp_path / "x.json")


def test_sse_lines():
    token = parse_sse_line(b'data: {"choices": [{"text": "hi", "finish_reason": null}]}\n')
    assert token == Chunk("hi") and token.is_token
    last = parse_sse_line('data: {"choices": [{"text": "", "finish_reason": "length"}], '
                          '"usage": {"completion_tokens": 8}}')
    assert last == Chunk("", "length", 8) and not last.is_token
    assert parse_sse_line(b"data: [DONE]\n") is DONE
    assert parse_sse_line(b"\n") is None and parse_sse_line(b": keep-alive\n") is None
    with pytest.raises(StreamError, match="boom"):
        parse_sse_line(b'data: {"error": {"message": "boom"}}')
    with pytest.raises(StreamError, match="not JSON"):
        parse_sse_line(b"data: {oops")


def test_stream_timing_follows_vllm_definitions():
    timing = StreamTiming(sent=10.0)
    for t in (10.2, 10.25, 10.35):
        timing.token(t)
    timing.end(10.4)
    assert timing.ttft == pytest.approx(0.2)
    assert timing.inter_token == pytest.approx([0.05, 0.1])
    assert timing.e2e == pytest.approx(0.4)
    assert timing.tokens == 3
    timing.reported_tokens = 5  # the server merged tokens into fewer chunks
    assert timing.tokens == 5
