"""``--api chat``: the Locust users drive ``/v1/chat/completions`` and read chat streams.

The vLLM-format chat stream below is written from vLLM's ``serving_chat.py``
(``chat_completion_stream_generator``: a first chunk whose delta is the role, one chunk per step
with ``delta.content``, the last step's chunk with ``finish_reason``, then with
``stream_options.include_usage`` a chunk with ``choices: []`` and ``usage``); ids and texts are
made up. The Locust run at the end drives a real in-process gpuscope server.
"""

from __future__ import annotations

import random

from gpuscope.loadtest.options import Workload
from gpuscope.loadtest.recorder import load_samples
from gpuscope.loadtest.sse import DONE, Chunk, StreamTiming, parse_sse_line
from gpuscope.server.chat import ChatTemplate, parse_chat
from gpuscope.server.config import ServerConfig

from ..conftest import wait_for
from ..server.conftest import ServerThread, small_config
from .conftest import LocustProcess, csv_request_count

HEAD = '"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m"'
VLLM_CHAT = [
    f'data: {{{HEAD},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
    '"logprobs":null,"finish_reason":null}]}',
    f'data: {{{HEAD},"choices":[{{"index":0,"delta":{{"content":" the"}},"logprobs":null,'
    '"finish_reason":null}]}',
    f'data: {{{HEAD},"choices":[{{"index":0,"delta":{{"content":""}},"logprobs":null,'
    '"finish_reason":null}]}',  # half a UTF-8 character: a step, no text
    f'data: {{{HEAD},"choices":[{{"index":0,"delta":{{"content":"é"}},"logprobs":null,'
    '"finish_reason":"length","stop_reason":null}]}',
    f'data: {{{HEAD},"choices":[],"usage":{{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3}}}}',
    "data: [DONE]",
]


def test_vllm_chat_stream_role_chunk_is_not_a_token():
    timing, now, text = StreamTiming(sent=0.0), 0.0, ""
    for line in VLLM_CHAT:
        chunk = parse_sse_line(line)
        now += 1.0
        if chunk is DONE:
            break
        assert isinstance(chunk, Chunk)
        timing.chunk(chunk, now)
        text += chunk.text
    assert text == " theé"
    assert timing.token_times == [2.0, 3.0, 4.0]  # the role chunk (at 1.0) and usage chunk are no tokens
    assert timing.ttft == 2.0 and timing.tokens == 3 and timing.finish_reason == "length"


def test_chat_requests_are_what_the_server_parses():
    class Options:
        output_tokens = "fixed:n=5"
        api = "chat"

    body = Workload.from_options(Options()).request_body(random.Random(0), model="")
    assert set(body) == {"messages", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos"}
    plain = Workload.from_options(None).request_body(random.Random(0), model="")
    assert body["messages"] == [{"role": "user", "content": plain["prompt"]}]  # same prompts per seed
    completion, _ = parse_chat(body, ServerConfig().validate(), ChatTemplate(None))
    assert completion.stream and completion.include_usage and completion.max_tokens == 5


def test_locust_drives_the_servers_chat_api(tmp_path):
    server = ServerThread(small_config()).start()
    try:
        finished, samples, prefix = 4, tmp_path / "samples.json", tmp_path / "run"
        with LocustProcess(["--host", server.url, "-u", "2", "-r", "2", "--api", "chat",
                            "--output-tokens", "fixed:n=6", "--prompt-tokens", "fixed:n=20",
                            "--samples-file", str(samples), "--csv", str(prefix), "--only-summary"],
                           tmp_path, env={"GPUSCOPE_LOAD_TENANTS": "alpha:1"}) as locust:
            wait_for(lambda: locust.running() and (csv_request_count(prefix, "end_to_end") or 0) >= finished,
                     timeout=120, what=f"{finished} chat requests finished")
            result = locust.stop()
        assert result.returncode == 0, result.stderr[-2000:]
        ok = [r for r in load_samples(samples)["requests"] if not r["cut"]]
        assert len(ok) >= finished and all(r["ok"] for r in ok), [r["error"] for r in ok][:3]
        assert all(r["tokens"] == 6 for r in ok)  # ignore_eos: every request generates max_tokens
        served = server.metric("gpuscope_requests_total", {"tenant": "alpha", "outcome": "length"})
        assert served >= len(ok)
    finally:
        server.stop()
