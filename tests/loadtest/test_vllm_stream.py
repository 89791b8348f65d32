"""vLLM's OpenAI server: what the Locust users send it, and how they read its stream.

``fixtures/vllm_*.sse`` are stream bodies in vLLM's format (their comments name the vLLM
source they follow). The Locust run at the end uses the paced server's vLLM dialect, which
streams the same shapes and, like vLLM, rejects a request that names a model it does not serve.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gpuscope.loadtest.options import Workload
from gpuscope.loadtest.recorder import load_samples
from gpuscope.loadtest.sse import DONE, Chunk, StreamError, StreamTiming, parse_sse_line
from gpuscope.server.config import ServerConfig
from gpuscope.server.protocol import parse_completion

from ..conftest import wait_for
from .conftest import LocustProcess, csv_request_count

FIXTURES = Path(__file__).with_name("fixtures")
SENT, STEP = 100.0, 0.25  # replayed lines arrive STEP apart, the first STEP after sending


def replay(lines: list[str]) -> tuple[StreamTiming, bool, str]:
    """Parse a stream body line by line as the user does: (timing, [DONE] seen, text received)."""
    timing, done, text = StreamTiming(sent=SENT), False, ""
    now = SENT
    for line in lines:
        chunk = parse_sse_line(line)
        if chunk is None:
            continue
        now += STEP
        if chunk is DONE:
            done = True
        else:
            assert isinstance(chunk, Chunk) and not done, line
            timing.chunk(chunk, now)
            text += chunk.text
    timing.end(now)
    return timing, done, text


def test_vllm_stream_with_ignore_eos_every_step_is_a_token_and_usage_gives_the_count():
    timing, done, text = replay((FIXTURES / "vllm_completions_ignore_eos.sse").read_text().splitlines())
    assert done and text == " the kernel queueé batch of tokens"
    # Eight steps, eight arrivals: the step with empty text (half a character) and the last step,
    # which carries finish_reason and its own text, are arrivals too; the usage chunk is not.
    assert len(timing.token_times) == 8
    assert timing.ttft == pytest.approx(STEP)
    assert timing.inter_token == pytest.approx([STEP] * 7)
    assert timing.reported_tokens == timing.tokens == 8
    assert timing.finish_reason == "length"
    assert timing.e2e == pytest.approx(10 * STEP)  # 8 chunks, usage, [DONE]


def test_vllm_stream_ending_at_eos():
    timing, done, text = replay((FIXTURES / "vllm_completions_eos.sse").read_text().splitlines())
    assert done and text == " Paris.\n"
    # The EOS step sends empty text with finish_reason "stop": still the arrival of a token, which
    # usage counts (4 = three texts + EOS).
    assert len(timing.token_times) == 4 and timing.tokens == 4
    assert timing.finish_reason == "stop"


def test_usage_chunk_parses_instead_of_failing():
    usage = parse_sse_line('data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
                           '"choices":[],"usage":{"prompt_tokens":3,"total_tokens":8,"completion_tokens":5}}')
    assert usage == Chunk("", None, 5, has_choice=False) and not usage.is_token


def test_gpuscope_serve_closing_chunk_is_a_summary_not_a_token():
    # gpuscope serve: tokens that decode to text, then finish_reason and usage on one chunk whose
    # text is the decoder's flush (here half a character that arrived with an earlier token).
    lines = ['data: {"choices": [{"index": 0, "text": " a", "finish_reason": null}]}',
             'data: {"choices": [{"index": 0, "text": " b", "finish_reason": null}]}',
             'data: {"choices": [{"index": 0, "text": "\\ufffd", "finish_reason": "length"}], '
             '"usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}',
             "data: [DONE]"]
    timing, done, _ = replay(lines)
    assert done and len(timing.token_times) == 2 and timing.tokens == 3


def test_chunks_without_a_choice_never_give_the_first_token():
    lines = ['data: {"choices": [], "prompt_filter_results": []}',
             'data: {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}',
             'data: {"choices": [], "usage": {"completion_tokens": 1}}', "data: [DONE]"]
    timing, done, _ = replay(lines)
    assert done and timing.ttft == pytest.approx(2 * STEP) and timing.tokens == 1


def test_a_stream_in_one_chunk_still_has_a_first_token():
    # vLLM answers a stream it cannot stream (n != best_of) with the whole response in one chunk.
    lines = ['data: {"choices": [{"index": 0, "text": "all of it", "finish_reason": "length"}], '
             '"usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}', "data: [DONE]"]
    timing, _, _ = replay(lines)
    assert timing.ttft == pytest.approx(STEP) and timing.tokens == 3


@pytest.mark.parametrize(("line", "needle"), [
    ('data: {"error": {"message": "boom", "type": "BadRequestError", "param": null, "code": 400}}', "boom"),
    ('data: {"object": "error", "message": "old boom", "type": "BadRequestError", "code": 400}', "old boom"),
    ('data: {"id": "cmpl-1", "object": "text_completion"}', "without choices"),
    ('data: {"choices": [{"text": 5}]}', "not a string"),
])
def test_stream_errors_are_one_line(line, needle):
    with pytest.raises(StreamError, match=needle):
        parse_sse_line(line)


def test_requests_carry_what_vllm_reads_and_gpuscope_serve_accepts():
    class Options:
        output_tokens = "fixed:n=5"
        model = "meta-llama/Llama-3.1-8B-Instruct"

    body = Workload.from_options(Options()).request_body(random.Random(0))
    assert body["model"] == "meta-llama/Llama-3.1-8B-Instruct" and body["max_tokens"] == 5
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert set(body) == {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options",
                         "ignore_eos"}
    # gpuscope serve takes the same body when it names the served model (as vLLM, it answers 404 for
    # another; the users ask GET /v1/models for the name).
    config = ServerConfig().validate()
    completion = parse_completion({**body, "model": config.model_name}, config)
    assert completion.stream and completion.max_tokens == 5

    class Plain:
        ignore_eos = "false"

    plain = Workload.from_options(Plain()).request_body(random.Random(0), model="")
    assert "ignore_eos" not in plain and "model" not in plain
    # The fields added do not change which prompts a seed gives.
    assert plain["prompt"] == Workload.from_options(None).request_body(random.Random(0))["prompt"]


def test_locust_against_a_vllm_style_server(paced_server, tmp_path):
    finished, users = 16, 4
    paced_server.first_s, paced_server.gap_s, paced_server.hold_after = 0.05, 0.02, finished
    paced_server.dialect, paced_server.model = "vllm", "org/paced-7b"
    samples, prefix = tmp_path / "samples.json", tmp_path / "run"
    # No --model: the users ask GET /v1/models, as they would a vLLM server.
    with LocustProcess(["--host", paced_server.url + "/v1", "-u", str(users), "-r", str(users),
                        "--output-tokens", "fixed:n=4", "--samples-file", str(samples),
                        "--csv", str(prefix), "--only-summary"], tmp_path,
                       env={"GPUSCOPE_LOAD_API_KEY": "sk-test"}) as locust:
        wait_for(lambda: locust.running() and len(paced_server.held) == users, timeout=120,
                 what=f"all {users} users in a held stream")
        wait_for(lambda: locust.running() and csv_request_count(prefix, "end_to_end") == finished,
                 timeout=30, what="Locust's CSV to count every finished request")
        result = locust.stop()
    assert result.returncode == 0, result.stderr[-2000:]
    for body in paced_server.received:
        assert body["model"] == "org/paced-7b" and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["authorization"] == "Bearer sk-test"
    ok = [r for r in load_samples(samples)["requests"] if not r["cut"]]
    assert len(ok) == finished and all(r["ok"] for r in ok), [r["error"] for r in ok][:3]
    # Four steps each: the empty-text step and the finishing step are arrivals, the usage chunk is not.
    assert all(r["tokens"] == 4 and len(r["itl"]) == 3 for r in ok)
