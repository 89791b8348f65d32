"""Chat completions, vLLM's /health, the served-model check, stop strings and the TTFT clients see.

Against a real in-process server with the toy model: greedy chat output is the greedy completion of the
prompt the documented simple template renders, which is how these tests know what to expect.
"""

from __future__ import annotations

import json

import pytest
import requests

from gpuscope.server.chat import ChatTemplate, parse_messages, simple_template
from gpuscope.server.protocol import BadRequest
from gpuscope.server.stops import StopStrings
from tests.conftest import wait_for
from tests.server.conftest import ServerThread, small_config

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]


def sse_events(response: requests.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events


def chat(server: ServerThread, **body) -> requests.Response:
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, **body}
    url = server.url + "/v1/chat/completions"
    return requests.post(url, json=body, timeout=30, stream=body.get("stream"))


# --- pure parts ---------------------------------------------------------------------------------


def test_stop_strings_span_pieces_and_hold_back_only_possible_starts():
    stops = StopStrings(("END", "xy"))
    assert stops.feed("abc") == ("abc", None)  # nothing here can start a stop string
    assert stops.feed("dE") == ("d", None)  # "E" may start "END": held
    assert stops.feed("Nq") == ("ENq", None)  # "ENq" is not "END": released
    assert stops.feed("zE") == ("z", None)
    assert stops.feed("ND and more") == ("", "END")  # the stop string and what follows are never sent
    other = StopStrings(("xy",))
    assert other.feed("ax") == ("a", None)
    assert other.flush() == "x"  # generation ended for another reason: the held text goes out
    first = StopStrings(("bc", "abcd"))
    assert first.feed("zabcd") == ("z", "abcd")  # the earliest match in the text wins
    with pytest.raises(ValueError):
        StopStrings(("",))


def test_simple_template_and_message_parsing():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None}]
    messages = parse_messages(parts)
    assert messages == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    assert simple_template(messages) == "<|user|>\na\nb\n<|assistant|>\n\n<|assistant|>\n"
    template = ChatTemplate(None)
    assert template.name == "simple" and template.add_special_tokens
    for bad, words in (([], "non-empty list"), ([{"role": "wizard", "content": "x"}], "'wizard'"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text"),
                       ([{"role": "user"}], "is required"), (["hello"], "must be an object")):
        with pytest.raises(BadRequest) as err:
            parse_messages(bad)
        assert err.value.status == 400 and words in err.value.message


# --- over HTTP ----------------------------------------------------------------------------------


def test_health_is_vllms_empty_200(server):
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert requests.get(server.url + "/healthz", timeout=10).json() == {"status": "ok"}


def test_chat_answers_in_vllms_shape_with_the_simple_template(server):
    r = chat(server)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "gpuscope-tiny"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("length", "stop")
    prompt = simple_template(MESSAGES)
    usage = body["usage"]
    assert usage["prompt_tokens"] == 1 + len(prompt.encode())  # BOS + bytes of the rendered template
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    plain = server.complete(prompt, max_tokens=12).json()["choices"][0]["text"]
    assert choice["message"]["content"] == plain  # greedy: the same model run on the same prompt
    assert r.headers["X-Trace-Id"]


def test_chat_stream_chunks_and_usage(server):
    whole = chat(server).json()["choices"][0]["message"]["content"]
    r = chat(server, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] >= 1
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] in ("length", "stop")
    assert all("usage" not in c for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole
    plain = sse_events(chat(server, stream=True))
    assert all("usage" not in c for c in plain[:-1]) and plain[-2]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_stop_string_ends_the_output_before_it(server, api):
    def run(**extra) -> dict:
        if api == "chat":
            body = chat(server, max_tokens=24, **extra).json()
            choice = body["choices"][0]
            return {"text": choice["message"]["content"], **choice}
        return server.complete("stop here", max_tokens=24, **extra).json()["choices"][0]

    full = run()["text"]
    assert len(full) >= 6, full
    stop = full[3:5]
    cut = full.index(stop)
    for value in (stop, ["\x00never", stop]):
        got = run(stop=value)
        assert got["text"] == full[:cut] and got["finish_reason"] == "stop" and got["stop_reason"] == stop
    untouched = run(stop="\x00never")
    assert untouched["text"] == full and untouched["stop_reason"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_vllms_404(server, path):
    body = {"model": "not-served", "prompt": "x", "messages": MESSAGES, "max_tokens": 2}
    r = requests.post(server.url + path, json=body, timeout=10)
    assert r.status_code == 404
    message = "The model `not-served` does not exist."
    assert r.json() == {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}
    ok = requests.post(server.url + path, json={**body, "model": "gpuscope-tiny"}, timeout=30)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", [("logprobs", 2), ("echo", True), ("best_of", 3), ("n", 2),
                                         ("stop", 5), ("stop", ["a", 1]), ("tools", [{"type": "function"}]),
                                         ("stream_options", {"include_usage": "yes"})])
def test_unsupported_fields_are_a_clear_400(server, path, field, value):
    body = {"prompt": "x", "messages": MESSAGES, "max_tokens": 2, field: value}
    if field == "logprobs" and path.endswith("chat/completions"):
        body[field] = True
    r = requests.post(server.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field.split("_")[0] in error["message"]


def test_ignored_fields_are_accepted(server):
    extra = {"top_p": 0.5, "seed": 3, "presence_penalty": 0.1, "user": "u", "logprobs": False,
             "echo": False, "n": 1}
    r = chat(server, **extra)
    assert r.status_code == 200, r.text


def test_chat_without_max_tokens_fills_up_to_the_limit(server):
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == server.config.max_tokens_limit


def test_client_ttft_counts_only_requests_that_sent_text(server):
    """TTFT as clients see it waits for non-empty text; the engine's TTFT does not."""

    def counts() -> tuple[float, float]:
        return (server.metric("gpuscope_request_ttft_seconds_count", {"tenant": "alpha"}) or 0.0,
                server.metric("gpuscope_request_engine_ttft_seconds_count", {"tenant": "alpha"}) or 0.0)

    full = chat(server, max_tokens=8).json()["choices"][0]["message"]["content"]
    client0, engine0 = counts()
    silent = sse_events(chat(server, max_tokens=8, stream=True, stop=full[:2]))  # stops before any text
    assert silent[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in silent[:-1]) == ""
    assert counts() == (client0, engine0 + 1)
    sse_events(chat(server, max_tokens=8, stream=True))
    assert counts() == (client0 + 1, engine0 + 2)
    client_sum = server.metric("gpuscope_request_ttft_seconds_sum", {"tenant": "alpha"})
    engine_sum = server.metric("gpuscope_request_engine_ttft_seconds_sum", {"tenant": "alpha"})
    assert client_sum > 0 and engine_sum > 0


def test_event_loop_lag_and_delivery_are_sampled(server):
    chat(server, max_tokens=4)
    wait_for(lambda: (server.metric("gpuscope_event_loop_lag_seconds_count") or 0) >= 3, timeout=10,
             what="loop lag samples")
    assert (server.metric("gpuscope_event_delivery_seconds_count") or 0) >= 1


def test_vllm_names_keep_engine_side_ttft():
    srv = ServerThread(small_config(metric_names="vllm")).start()
    try:
        r = requests.post(srv.url + "/v1/chat/completions", timeout=30,
                          json={"messages": MESSAGES, "max_tokens": 3, "model": "gpuscope-tiny"})
        assert r.status_code == 200, r.text
        labels = {"model_name": "gpuscope-tiny", "engine": "0"}
        assert srv.metric("vllm:time_to_first_token_seconds_count", labels) == 1
        assert srv.metric("gpuscope_request_ttft_seconds_count", {"tenant": "alpha"}) is None
    finally:
        srv.stop()
