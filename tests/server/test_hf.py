"""``gpuscope serve --model.hf DIR`` with real ``transformers`` on CPU, on a tiny random Llama.

The model and its tokenizer are made here, offline: a byte-level BPE trained in memory on a few
sentences (wrapped in ``PreTrainedTokenizerFast``) and ``LlamaForCausalLM(LlamaConfig(...))``, both
saved with ``save_pretrained``. The reference for every output is plain unbatched greedy decoding: one
full forward per token, no cache. One LM-head row swap makes the model end ``EOS_PROMPT`` with the
tokenizer's EOS after a known number of tokens.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
import torch

pytest.importorskip("transformers")

from gpuscope.loadtest.serverproc import ServerProcess
from gpuscope.server.config import ModelSpec, parse_tenants
from gpuscope.server.engine import Done, Engine, Failed, Request
from gpuscope.server.hf import HFStreamDecoder, load_runner
from gpuscope.server.model import encode
from gpuscope.server.scheduler import Scheduler
from gpuscope.server.step_timing import build_timer
from tests.conftest import wait_for
from tests.logs.test_loki_push import Receiver
from tests.server.conftest import ServerThread, small_config

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
SENTENCES = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo ✓ unicode",
             "gpuscope serves a tiny llama", "tokens stream as server-sent events"]
PROMPTS = ["hello", "the quick brown fox", "héllo ✓ wide", "x"]
EOS_PROMPT = "the lazy dog"
EOS_ID = 2
LLAMA_OPS = ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.0.mlp",
             "model.layers.1.self_attn", "model.layers.1.mlp", "lm_head"]


def build_tokenizer():
    """Byte-level BPE trained in memory (any text encodes); adds <s>, ends with </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_llama(vocab: int, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0, tie_word_embeddings=False,
                         initializer_range=0.2)  # well-separated logits: greedy has no near-ties
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def greedy(model, ids: list[int], n: int, eos: int | None = EOS_ID) -> list[int]:
    """Unbatched greedy decoding, one full forward per token (no cache): the reference."""
    out: list[int] = []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


def save_tiny_llama(path: Path) -> int:
    """Save the tokenizer and a tiny Llama that ends EOS_PROMPT with EOS; returns that EOS's index."""
    tokenizer = build_tokenizer()
    model = tiny_llama(len(tokenizer))
    prompt = tokenizer.encode(EOS_PROMPT)
    ref = greedy(model, prompt, 12, eos=None)
    k = next(i for i in range(2, 12) if ref[i] not in ref[:i] and EOS_ID not in ref[: i + 1])
    with torch.no_grad():  # swap two LM-head rows: step k's argmax becomes EOS, earlier steps keep theirs
        head = model.lm_head.weight
        head[[ref[k], EOS_ID]] = head[[EOS_ID, ref[k]]].clone()
    assert greedy(model, prompt, 12) == [*ref[:k], EOS_ID]
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return k


class Tiny:
    """The saved model folder, the model and tokenizer as loaded from it, and reference outputs."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = path
        self.eos_at = save_tiny_llama(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def reference(self, prompt: str, n: int) -> list[int]:
        return greedy(self.model, self.ids(prompt), n)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("tiny-llama"))


def cpu_spec(tiny: Tiny) -> ModelSpec:
    """On CPU in float32 on any host: the references are float32 CPU forwards, compared token for token."""
    return ModelSpec(hf=str(tiny.path), context=256, device="cpu", dtype="float32")


def hf_config(tiny: Tiny, **overrides):
    return small_config(model=cpu_spec(tiny), **overrides)


@pytest.fixture(scope="module")
def hf_server(tiny):
    srv = ServerThread(hf_config(tiny)).start()
    yield srv
    srv.stop()


# --- the runner: batching, joining, leaving, preemption -------------------------------------------


def test_runner_batches_joins_and_frees_with_unbatched_greedy_outputs(tiny):
    runner = load_runner(cpu_spec(tiny))
    n = 10
    refs = {slot: tiny.reference(p, n) for slot, p in enumerate(PROMPTS)}
    toks = {slot: runner.tokenize(encode(p)) for slot, p in enumerate(PROMPTS)}
    assert toks[0] == tiny.ids(PROMPTS[0])
    out: dict[int, list[int]] = {slot: [] for slot in toks}

    def take(slots, logits):
        for slot, token in zip(slots, logits.argmax(-1).tolist(), strict=True):
            out[slot].append(token)

    def step(slots):
        take(slots, runner.decode(slots, [out[s][-1] for s in slots],
                                  [len(toks[s]) + len(out[s]) - 1 for s in slots]))

    with torch.inference_mode():
        runner.warm_up()
        take([0, 1], runner.prefill([0, 1], [toks[0], toks[1]]))  # different lengths: left padding
        for _ in range(3):
            step([1, 0])  # any row order
        take([2, 3], runner.prefill([2, 3], [toks[2], toks[3]]))  # prefilled while 0 and 1 decode
        step([0, 1])
        while any(len(o) < n for o in out.values()):
            live = [s for s in out if len(out[s]) < n and out[s][-1] != EOS_ID]
            if not live:
                break
            step(live)
            for slot in live:  # rows leave one by one as they finish; the rest keep decoding
                if len(out[slot]) >= n or out[slot][-1] == EOS_ID:
                    runner.free(slot)
    assert out == refs
    assert runner._batch is None and runner._pending == []


def other_architecture(name: str, vocab: int):
    import transformers

    torch.manual_seed(0)
    common = {"vocab_size": vocab, "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": EOS_ID}
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
        return transformers.GPT2LMHeadModel(config).eval()
    config_class, model_class = {"mistral": ("MistralConfig", "MistralForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[name]
    extra = {"sliding_window": 5} if name == "mistral" else {}  # shorter than the sequences: it matters
    config = getattr(transformers, config_class)(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 **common, **extra)
    return getattr(transformers, model_class)(config).eval()


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gpt2"])
def test_runner_matches_unbatched_greedy_on_other_architectures(name):
    from gpuscope.server.hf import HFRunner

    tokenizer = build_tokenizer()
    model = other_architecture(name, len(tokenizer))
    runner = HFRunner(model, tokenizer, 256, frozenset({EOS_ID}))
    refs = {slot: greedy(model, tokenizer.encode(p), 12) for slot, p in enumerate(PROMPTS)}
    toks = {slot: runner.tokenize(encode(p)) for slot, p in enumerate(PROMPTS)}
    out: dict[int, list[int]] = {slot: [] for slot in toks}

    def take(slots, logits):
        for slot, token in zip(slots, logits.argmax(-1).tolist(), strict=True):
            out[slot].append(token)

    with torch.inference_mode():
        take([0, 1], runner.prefill([0, 1], [toks[0], toks[1]]))
        for step in range(16):
            if step == 2:
                take([2, 3], runner.prefill([2, 3], [toks[2], toks[3]]))
                continue
            live = [s for s in out if out[s] and len(out[s]) < len(refs[s])]
            if not live:
                break
            take(live, runner.decode(live, [out[s][-1] for s in live],
                                     [len(toks[s]) + len(out[s]) - 1 for s in live]))
            for slot in live:
                if len(out[slot]) == len(refs[slot]):
                    runner.free(slot)
    assert out == refs


def test_preempted_request_resumes_with_the_same_tokens(tiny):
    runner = load_runner(cpu_spec(tiny))
    scheduler = Scheduler(parse_tenants("hi:0.5:high,lo:0.5:low"), "share", 100)
    timer = build_timer("off", None)
    done = threading.Event()
    lo = Request("lo", encode(PROMPTS[1]), 24, 0.0)
    hi = Request("hi", encode(PROMPTS[0]), 6, 0.0)
    submitted: list[Request] = []

    def on_step(op, batch, seconds):
        # In the engine thread between steps: hi arrives while lo decodes, in the one slot there is.
        if len(lo.generated) == 3 and not submitted:
            submitted.append(hi)
            engine.submit(hi)

    def deliver(events):
        if all(r.outcome for r in (lo, hi)) and any(isinstance(e, Done | Failed) for _, e in events):
            done.set()

    engine = Engine(runner, scheduler, timer, batch_size=1, max_wait_s=0.0, deliver=deliver, on_step=on_step,
                    log_requests=False)
    engine.start()
    try:
        engine.submit(lo)
        assert done.wait(60), (lo.outcome, hi.outcome)
    finally:
        engine.stop()
    assert scheduler.state()["lo"].preemptions == 1
    assert hi.finished_at is not None and lo.finished_at is not None and hi.finished_at < lo.finished_at
    assert hi.generated == tiny.reference(PROMPTS[0], 6)
    assert lo.generated == tiny.reference(PROMPTS[1], 24)  # re-prefilled with prompt + generated


def test_stream_decoder_pieces_add_up_to_the_full_decode(tiny):
    ids = tiny.ids("héllo ✓ the quick brown fox")
    prompt, generated = ids[:3], [*ids[3:], EOS_ID]
    decoder = HFStreamDecoder(tiny.tokenizer, prompt)
    pieces = [decoder.feed(t) for t in generated]
    assert "".join(pieces) + decoder.finish() == tiny.text(ids)[len(tiny.text(prompt)):]
    assert all("\ufffd" not in p for p in pieces)  # split characters wait for their last byte


def test_latency_spike_repeats_mlp_work_inside_the_mlp_and_keeps_outputs(tiny):
    runner = load_runner(cpu_spec(tiny))
    ids = tiny.ids("hello")
    with torch.inference_mode():
        expected = runner.prefill([0], [ids])
        runner.free(0)
        calls = []
        down = runner.module.model.layers[0].mlp.down_proj
        probe = down.register_forward_hook(lambda *a: calls.append(1))
        runner.set_extra_passes(3)
        assert torch.equal(runner.prefill([0], [ids]), expected)
        runner.free(0)
        assert sum(len(m._forward_hooks) for m in runner.module.modules()) == 1 + 3 * 2  # 3 weights × 2 MLPs
        runner.set_extra_passes(0)
        probe.remove()
    assert sum(len(m._forward_hooks) for m in runner.module.modules()) == 0
    assert len(calls) == 1  # the repeats call forward directly, inside the hooked module's call


# --- the server ---------------------------------------------------------------------------------


def test_completions_answer_unbatched_greedy_text_and_stream_the_same(hf_server, tiny):
    prompt = "héllo ✓ wide"
    ref = tiny.reference(prompt, 12)
    r = hf_server.complete(prompt, max_tokens=12, tenant="alpha")
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == tiny.text(ref)
    assert choice["finish_reason"] == ("stop" if ref[-1] == EOS_ID else "length")
    assert body["usage"] == {"prompt_tokens": len(tiny.ids(prompt)), "completion_tokens": len(ref),
                             "total_tokens": len(tiny.ids(prompt)) + len(ref)}
    streamed = requests.post(hf_server.url + "/v1/completions", stream=True, timeout=30,
                             json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True})
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in streamed.iter_lines(decode_unicode=True)
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 2  # text arrives token by token
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["usage"] == body["usage"]


def test_generation_stops_at_the_tokenizers_eos(hf_server, tiny):
    r = hf_server.complete(EOS_PROMPT, max_tokens=32, tenant="beta")
    assert r.status_code == 200, r.text
    body = r.json()
    ref = tiny.reference(EOS_PROMPT, 32)
    assert ref[-1] == EOS_ID and len(ref) == tiny.eos_at + 1
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == tiny.eos_at + 1  # the EOS token counts, its text is empty
    assert body["choices"][0]["text"] == tiny.text(ref[:-1])


def test_per_module_regions_carry_the_hf_module_names(hf_server):
    assert hf_server.complete("hello", max_tokens=3).status_code == 200
    assert hf_server.service.timer.flush(10)
    for op in [*LLAMA_OPS, "prefill", "decode"]:
        count = hf_server.metric("gpuscope_region_gpu_seconds_count", {"op": op, "device": "cpu"})
        assert count and count > 0, op
    toy_op = {"op": "blocks.0.attn", "device": "cpu"}
    assert hf_server.metric("gpuscope_region_gpu_seconds_count", toy_op) is None
    assert b'op="model.layers.1.mlp"' in requests.get(hf_server.url + "/metrics", timeout=10).content


def test_request_log_counts_the_models_tokens(hf_server, tiny, caplog):
    with caplog.at_level(logging.INFO, logger="gpuscope.server.requests"):
        r = hf_server.complete("the quick brown fox", max_tokens=2, tenant="beta")
        assert r.status_code == 200
        wait_for(lambda: any(r.headers["X-Trace-Id"] in rec.getMessage() for rec in caplog.records),
                 what="request log line")
    line = next(json.loads(rec.getMessage()) for rec in caplog.records
                if r.headers["X-Trace-Id"] in rec.getMessage())
    assert line["prompt_tokens"] == len(tiny.ids("the quick brown fox")) < len(encode("the quick brown fox"))
    assert line["tenant"] == "beta" and line["completion_tokens"] == 2


def test_concurrent_requests_share_batches_and_match_unbatched_greedy(tiny):
    # A long batch window: the four requests (two per tenant) start as one prefill of four, whatever
    # the machine's load; they then decode together and leave the batch at different steps.
    srv = ServerThread(hf_config(tiny, max_wait_s=10.0)).start()
    prompts = [*PROMPTS[:3], EOS_PROMPT]
    tenants = ["alpha", "beta", "alpha", "beta"]
    results: dict[int, requests.Response] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, srv.complete(prompts[i], max_tokens=8 + 2 * i, tenant=tenants[i]))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, prompt in enumerate(prompts):
            assert results[i].status_code == 200, results[i].text
            ref = tiny.reference(prompt, 8 + 2 * i)
            assert results[i].json()["choices"][0]["text"] == tiny.text(ref), prompt
            assert results[i].json()["usage"]["completion_tokens"] == len(ref)
        hist = {le: srv.metric("gpuscope_batch_size_bucket", {"phase": "prefill", "le": le})
                for le in ("1.0", "2.0", "4.0")}
        assert hist == {"1.0": 0, "2.0": 0, "4.0": 1}  # one prefill of all four
        decode_steps = srv.metric("gpuscope_batch_size_count", {"phase": "decode"})
        single = srv.metric("gpuscope_batch_size_bucket", {"phase": "decode", "le": "1.0"})
        assert decode_steps > single  # decode steps of more than one request
        assert srv.service.timer.flush(10)
        for tenant in ("alpha", "beta"):  # both tenants were charged measured step time
            assert srv.metric("gpuscope_tenant_gpu_seconds_total", {"tenant": tenant}) > 0
            finished = sum(srv.metric("gpuscope_requests_total", {"tenant": tenant, "outcome": outcome})
                           for outcome in ("stop", "length"))
            assert finished == 2
    finally:
        srv.stop()


def test_faults_work_on_the_hf_model(tiny):
    from tests.server.conftest import TOKEN

    srv = ServerThread(hf_config(tiny, faults_enabled=True, faults_token=TOKEN)).start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        before = srv.complete("hello", max_tokens=4).json()["choices"][0]["text"]
        r = requests.post(srv.url + "/admin/faults/latency_spike", json={"extra_passes": 2, "duration_s": 60},
                          headers=auth, timeout=10)
        assert r.status_code == 200
        assert srv.complete("hello", max_tokens=4).json()["choices"][0]["text"] == before
        wait_for(lambda: srv.service.runner._spike_hooks, what="spike applied by the engine thread")
        requests.delete(srv.url + "/admin/faults/latency_spike", headers=auth, timeout=10)
        r = requests.post(srv.url + "/admin/faults/error_burst", headers=auth, timeout=10,
                          json={"error_ratio": 1.0, "log_lines_per_s": 0})
        assert r.status_code == 200
        failed = srv.complete("hello", max_tokens=4)
        assert failed.status_code == 500 and "CUDA out of memory" in failed.json()["error"]["message"]
    finally:
        srv.stop()


def test_a_prompt_over_the_context_in_model_tokens_fails_with_a_message(tiny):
    runner = load_runner(cpu_spec(tiny))
    engine = Engine(runner, Scheduler(parse_tenants("a:1"), "share", 10), build_timer("off", None),
                    batch_size=2, max_wait_s=0.0, deliver=lambda events: None, log_requests=False)
    engine.start()
    try:
        # Straight to the engine (the API would refuse it by its byte count first): 200 tokens + 60 > 256.
        req = Request("a", encode("x" * 200), 60, 0.0)
        engine.submit(req)
        wait_for(lambda: req.outcome, timeout=30, what="outcome")
    finally:
        engine.stop()
    assert req.outcome == "error" and req.tokens is not None and len(req.tokens) + 60 > 256
    assert req.generated == []


# --- `gpuscope serve --model.hf` as a process -----------------------------------------------------


@pytest.mark.slow
def test_serve_process_loads_the_folder_answers_and_logs_to_loki(tiny, tmp_path):
    receiver = Receiver().start()
    server = ServerProcess(["--model.hf", str(tiny.path), "--model.context", "256", "--model.device", "cpu",
                            "--request.max-tokens", "32", "--timing", "all", "--loki.url", receiver.url],
                           log_path=tmp_path / "serve.log", env={**ENV, "HF_HUB_OFFLINE": "1"})
    url = server.url
    try:
        server.start()
        models = requests.get(url + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == tiny.path.name and models["data"][0]["max_model_len"] == 256
        r = requests.post(url + "/v1/completions", timeout=30,
                          json={"prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tiny.text(tiny.reference("hello", 5))
        assert r.json()["model"] == tiny.path.name
        wait_for(lambda: 'op="model.layers.0.self_attn"' in requests.get(url + "/metrics", timeout=10).text,
                 timeout=30, what="per-module timing of the HF model")
        trace_id = r.headers["X-Trace-Id"]

        def request_line():
            for _labels, (_, line, meta) in receiver.entries:
                if meta.get("trace_id") == trace_id:
                    return json.loads(line)
            return None

        line = wait_for(request_line, timeout=30, what="request log line in Loki")
        assert line["prompt_tokens"] == len(tiny.ids("hello")) and line["completion_tokens"] == 5
    finally:
        try:
            server.stop(timeout_s=30)
        finally:
            receiver.stop()
    log = server.child.output()
    assert server.child.poll() in (0, -15), log
    assert "Loading weights" not in log  # no progress bars in the server's log


@pytest.fixture
def broken_folders(tiny, tmp_path) -> dict[str, Path]:
    def copy(name: str, files: tuple[str, ...]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for file in files:
            (folder / file).write_bytes((tiny.path / file).read_bytes())
        return folder

    return {"missing": tmp_path / "missing", "no config": copy("empty", ()),
            "no weights": copy("no-weights", ("config.json", "tokenizer.json", "tokenizer_config.json")),
            "no tokenizer": copy("no-tokenizer", ("config.json", "model.safetensors"))}


@pytest.mark.parametrize("case, message", [
    ("missing", "is not a local folder"),
    ("no config", "has no config.json"),
    ("no weights", "is not a loadable causal LM"),  # found only when transformers loads it, after the flags
])
def test_not_a_model_folder_exits_2_with_one_line(broken_folders, case, message):
    command = [sys.executable, "-m", "gpuscope", "serve", "--model.hf", str(broken_folders[case])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**ENV, "HF_HUB_OFFLINE": "1"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert lines[0].startswith("gpuscope serve: error: --model.hf ")


def test_load_errors_are_one_line_config_errors(tiny, broken_folders):
    from gpuscope.server.config import ConfigError

    cases = [(ModelSpec(hf=str(broken_folders["no tokenizer"])), "has no usable tokenizer"),
             (ModelSpec(hf=str(tiny.path), context=1024), "more than the model's 512 positions"),
             (ModelSpec(hf=str(tiny.path), checkpoint="x.pt"), "cannot go with --model.hf")]
    for spec, message in cases:
        with pytest.raises(ConfigError, match=message) as caught:
            load_runner(spec)
        assert "\n" not in str(caught.value)


def test_toy_model_stays_the_default():
    from gpuscope.server.main import load_config

    config = load_config([])
    assert config.model.hf is None and config.model_name == "gpuscope-tiny"
