"""The official ``openai`` Python client against the server: both APIs, streaming or not, and bad input.

What a user's code sees: parsed objects for good requests, and for bad ones the client's typed
exceptions (``BadRequestError``, ``NotFoundError``) carrying the server's message, never a 5xx.
"""

from __future__ import annotations

import pytest

from gpuscope.server.chat import simple_template

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Tell me about GPUs"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["gpuscope-tiny"]


def test_completions_plain_and_streamed_agree(client):
    done = client.completions.create(model="gpuscope-tiny", prompt="Hello", max_tokens=10, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason in ("length", "stop") and done.usage.prompt_tokens == 6
    chunks = list(client.completions.create(model="gpuscope-tiny", prompt="Hello", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_chat_plain_and_streamed_agree(client):
    done = client.chat.completions.create(model="gpuscope-tiny", messages=MESSAGES, max_tokens=10,
                                          temperature=0)
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    text = done.choices[0].message.content
    assert done.usage.prompt_tokens == 1 + len(simple_template(MESSAGES).encode())
    stream = client.chat.completions.create(model="gpuscope-tiny", messages=MESSAGES, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [done.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == done.usage.total_tokens


def test_chat_stop_string(client):
    def create(**kw):
        return client.chat.completions.create(model="gpuscope-tiny", messages=MESSAGES, max_tokens=16,
                                              temperature=0, extra_body={"ignore_eos": True}, **kw)

    text = create().choices[0].message.content
    assert len(text) >= 6, text
    stop = text[2:4]
    cut = create(stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bad_input_raises_the_clients_4xx_errors(client, api):
    def call(**kw):
        body = {"model": "gpuscope-tiny", "max_tokens": 4, **kw}
        if api == "chat":
            return client.chat.completions.create(messages=kw.pop("messages", MESSAGES),
                                                  **{k: v for k, v in body.items() if k != "messages"})
        return client.completions.create(prompt="hi", **body)

    with pytest.raises(openai.BadRequestError) as err:
        call(max_tokens=0)
    assert err.value.status_code == 400 and "max_tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        call(temperature=9)
    assert "temperature" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        call(model="gpt-4o")
    assert err.value.status_code == 404 and "`gpt-4o` does not exist" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        call(n=3)
    assert "'n'" in err.value.message
    if api == "chat":
        with pytest.raises(openai.BadRequestError) as err:
            call(messages=[{"role": "wizard", "content": "hi"}])
        assert "wizard" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            call(messages=[{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "data:,"}}]}])
        assert "only text" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # a streaming request fails before its stream
        list(call(max_tokens=10_000, stream=True))
    assert err.value.status_code == 400
