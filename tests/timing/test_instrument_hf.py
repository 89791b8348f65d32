"""README's "Timing Hugging Face models" recipe, with real ``transformers`` on CPU.

A tiny random Llama and its tokenizer are made and saved here (offline), loaded back with the Auto
classes as a user would, and timed with ``timer.instrument``: per-module histograms under the module
paths, through plain forwards and ``generate``. The module choice the server makes
(``gpuscope.server.hf.module_paths``) is checked on Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX shapes.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gpuscope.server.hf import module_paths  # noqa: E402
from tests.server.test_hf import LLAMA_OPS, build_tokenizer, tiny_llama  # noqa: E402


def counts(registry, ops):
    return {op: registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": "cpu"})
            for op in ops}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tokenizer = build_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval(),
            AutoTokenizer.from_pretrained(path, local_files_only=True))


def test_recipe_times_embedding_attention_mlp_and_head_by_module_path(make_timer, registry, saved):
    model, tokenizer = load(saved)
    timer = make_timer(sample_rate=1.0)
    inputs = tokenizer("the quick brown fox", return_tensors="pt")
    with torch.inference_mode():
        expected = model(**inputs).logits
    inst = timer.instrument(model, include=("embed_tokens", "self_attn", "mlp", "lm_head"))
    assert inst.ops == LLAMA_OPS
    with torch.inference_mode():
        assert torch.equal(model(**inputs).logits, expected)  # timing changes no output
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    assert timer.flush(10)
    assert set(counts(registry, LLAMA_OPS).values()) == {1 + 4}  # the forward, then one per generated token
    inst.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_default_include_picks_the_same_modules_on_llama(make_timer, saved):
    model, _ = load(saved)
    timer = make_timer(sample_rate=1.0)
    inst = timer.instrument(model)  # DEFAULT_NAMES (self_attn, mlp, lm_head) + nn.Embedding (embed_tokens)
    assert inst.ops == LLAMA_OPS
    inst.remove()


def test_budgeted_timer_samples_whole_passes(make_timer, registry, saved):
    model, tokenizer = load(saved)
    timer = make_timer(sample_rate=0.25)
    timer.instrument(model, include=module_paths(model))
    ids = tokenizer("hello world", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        for _ in range(8):
            model(input_ids=ids)
    assert timer.flush(10)
    sampled = counts(registry, LLAMA_OPS)
    assert len(set(sampled.values())) == 1 and 0 < sampled["lm_head"] < 8  # every module of a sampled pass


def tiny(config_class, model_class, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kw)
    return getattr(transformers, model_class)(config)


@pytest.mark.parametrize("model, expected", [
    (lambda: tiny("MistralConfig", "MistralForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
     LLAMA_OPS),
    (lambda: tiny("Qwen2Config", "Qwen2ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
     LLAMA_OPS),
    (lambda: tiny("GPT2Config", "GPT2LMHeadModel", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                  n_positions=64),
     ["transformer.wte", "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1.attn",
      "transformer.h.1.mlp", "lm_head"]),
    (lambda: tiny("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4),
     ["gpt_neox.embed_in", "gpt_neox.layers.0.attention", "gpt_neox.layers.0.mlp",
      "gpt_neox.layers.1.attention", "gpt_neox.layers.1.mlp", "<head>"]),
], ids=["mistral", "qwen2", "gpt2", "gpt-neox"])
def test_module_paths_across_architectures(make_timer, registry, model, expected):
    m = model().eval()
    head = next(path for path, module in m.named_modules() if module is m.get_output_embeddings())
    expected = [head if p == "<head>" else p for p in expected]  # GPT-NeoX: embed_out, or lm_head (newer)
    assert module_paths(m) == expected
    timer = make_timer(sample_rate=1.0)
    chosen = set(expected)
    inst = timer.instrument(m, include=lambda path, module: path in chosen)
    with torch.inference_mode():
        m(input_ids=torch.randint(0, 64, (1, 5)))
    assert timer.flush(10)
    assert set(counts(registry, inst.ops).values()) == {1}
