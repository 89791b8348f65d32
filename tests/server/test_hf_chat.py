"""Chat completions on a ``--model.hf`` model: its tokenizer's chat template, tokenized as vLLM does.

The tiny Llama of ``test_hf`` gets a chat template that writes its own BOS; the server must render it
and tokenize without adding special tokens again (one BOS, not two), and generate what unbatched
greedy decoding generates from exactly those ids.
"""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("transformers")

from tests.server.conftest import ServerThread, small_config
from tests.server.test_hf import Tiny, cpu_spec, greedy

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> Tiny:
    tiny = Tiny(tmp_path_factory.mktemp("tiny-llama-chat"))
    tiny.tokenizer.chat_template = TEMPLATE
    tiny.tokenizer.save_pretrained(tiny.path)
    return tiny


def test_chat_uses_the_tokenizers_template_with_one_bos(templated):
    ids = templated.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    bos = templated.tokenizer.bos_token_id
    assert ids[0] == bos and ids[1] != bos
    srv = ServerThread(small_config(model=cpu_spec(templated))).start()
    try:
        r = requests.post(srv.url + "/v1/chat/completions", timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        expected = greedy(templated.model, ids, 6)
        assert body["choices"][0]["message"]["content"] == templated.text(expected)
        bad = requests.post(srv.url + "/v1/chat/completions", timeout=30,
                            json={"messages": [{"role": "user", "content": [{"type": "audio"}]}]})
        assert bad.status_code == 400 and "only text" in bad.json()["error"]["message"]
    finally:
        srv.stop()
