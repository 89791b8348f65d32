"""A small GPT-style decoder with a slot-based KV cache, its byte-level tokenizer, and the runner interface.

Random weights from a fixed seed (or a local checkpoint: never a download), so
the server really generates tokens and the GPU does real work of a size set
by flags. Module names are what ``timer.instrument`` turns into op labels:
``embed``, ``blocks.N.attn``, ``blocks.N.mlp``, ``lm_head``.

The KV cache has one row ("slot") per running request. One forward serves
both phases: prefill (``start`` = 0, a right-padded prompt per row) and
decode (one token per row at its own position), so requests of different
lengths share a decode step.

``ModelRunner`` is what the engine drives: token ids in, next-token logits out,
one call per batched step, with the KV cache kept by the runner per slot.
``TinyRunner`` runs ``TinyGPT``; ``gpuscope.server.hf.HFRunner`` runs a local
Hugging Face causal LM.
"""

from __future__ import annotations

import codecs
import math
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from .config import Dtype, ModelSpec
from .decode_graphs import DecodeGraphs
from .step_timing import instrument_model

BOS = 256
EOS = 257
VOCAB = 258


class Decoder(Protocol):
    """Incremental detokenizer of one request: ``feed`` each generated token, ``finish`` at the end."""

    def feed(self, token: int) -> str: ...

    def finish(self) -> str: ...


class ModelRunner(Protocol):
    """The engine's view of a model: batched prefill and decode over KV-cache slots.

    The engine owns slot numbers (``0 .. slots-1``, one per running request) and calls everything
    from its one thread. Prompts reach it as the API's ids (``encode``: BOS, then UTF-8 bytes);
    ``tokenize`` turns them into the model's tokens.
    """

    module: Any  # the torch.nn.Module whose forward is one step (what timer.instrument wraps)
    device: torch.device
    context: int  # most tokens (prompt + generated) one slot holds
    eos_ids: frozenset[int]  # a generated token in here ends the request with finish_reason "stop"

    def allocate(self, slots: int) -> None:
        """Make room for ``slots`` concurrent requests; runs once, before the first step."""

    def tokenize(self, prompt: list[int], add_special_tokens: bool = True) -> list[int]:
        """The API's prompt ids (``encode``'s) → the model's token ids (never empty).

        ``add_special_tokens=False``: the text already has them (a chat template wrote the BOS).
        """

    def new_decoder(self, prompt: list[int]) -> Decoder:
        """Detokenizer for a request whose (model-token) prompt is ``prompt``."""

    def prefill(self, slots: list[int], rows: list[list[int]]) -> torch.Tensor:
        """Run whole sequences into fresh slots; logits of each row's next token, [rows, vocab].

        A preempted request comes back here with its prompt and what it had generated.
        """

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token per slot at ``positions`` (tokens already cached); next-token logits, [rows, vocab]."""

    def free(self, slot: int) -> None:
        """The slot's request finished or was preempted: forget its cache."""

    def warm_up(self) -> None:
        """One small prefill and decode outside any slot, so the first request pays no first-use cost."""

    def set_extra_passes(self, passes: int) -> None:
        """The latency_spike fault: repeat real work inside every timed MLP region ``passes`` times."""

    def instrument(self, timer) -> Any:
        """Per-module timing of ``module`` with ``timer``; returns what ``.remove()`` undoes."""


def encode(text: str) -> list[int]:
    """Prompt text → token ids: BOS, then the UTF-8 bytes."""
    return [BOS, *text.encode("utf-8")]


class StreamDecoder:
    """Token ids → text, one token at a time; bytes of a split UTF-8 character wait for the rest."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if token >= 256:
            return ""
        return self._decoder.decode(bytes((token,)))

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class Embed(nn.Module):
    def __init__(self, dim: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(context, dim)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(positions)


class Attention(nn.Module):
    """Causal self-attention that writes its keys/values into the cache rows of its batch."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        assert self.cache_k is not None and self.cache_v is not None
        if t == 1:
            self.cache_k[slots, :, start] = k[:, :, 0]
            self.cache_v[slots, :, start] = v[:, :, 0]
        else:
            self.cache_k[slots, :, :t] = k
            self.cache_v[slots, :, :t] = v
        span = mask.shape[-1]
        keys = self.cache_k[slots, :, :span]
        values = self.cache_v[slots, :, :span]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        # Set by the latency_spike fault: passes of real, discarded work inside this timed module,
        # so kernel-timing histograms and request latency rise as with a slow kernel.
        self.extra_passes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(F.gelu(self.up(x)))
        for _ in range(self.extra_passes):
            self.down(F.gelu(self.up(x)))
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x, slots, start, mask):
        x = x + self.attn(self.ln1(x), slots, start, mask)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer; ``allocate_cache`` must run before ``forward``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = Embed(spec.dim, spec.context)
        self.blocks = nn.ModuleList(Block(spec.dim, spec.heads) for _ in range(spec.layers))
        self.ln_f = nn.LayerNorm(spec.dim)
        self.lm_head = nn.Linear(spec.dim, VOCAB, bias=False)
        self.slots = 0

    def allocate_cache(self, slots: int) -> None:
        p = next(self.parameters())
        hd = self.spec.dim // self.spec.heads
        shape = (slots, self.spec.heads, self.spec.context, hd)
        for block in self.blocks:
            block.attn.cache_k = torch.zeros(shape, device=p.device, dtype=p.dtype)
            block.attn.cache_v = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.slots = slots

    def set_extra_passes(self, passes: int) -> None:
        for block in self.blocks:
            block.mlp.extra_passes = passes

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                last: torch.Tensor, span: int) -> torch.Tensor:
        """Logits of the token after position ``start + last`` of each row: [rows, VOCAB].

        tokens [rows, T] (right-padded for prefill), slots/start/last [rows]; ``span`` is the
        longest row's length after this step, passed from the host so no device sync is needed.
        """
        b, t = tokens.shape
        offsets = torch.arange(t, device=tokens.device)
        positions = start[:, None] + offsets[None, :]
        keys = torch.arange(span, device=tokens.device)
        mask = (keys[None, None, None, :] <= positions[:, None, :, None])
        x = self.embed(tokens, positions.clamp(max=self.spec.context - 1))
        for block in self.blocks:
            x = block(x, slots, start, mask)
        x = self.ln_f(x[torch.arange(b, device=x.device), last])
        return self.lm_head(x)


def pick_device(spec: ModelSpec) -> torch.device:
    if spec.device != "auto":
        return torch.device(spec.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    if spec.dtype == Dtype.AUTO:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, str(spec.dtype))


def avoid_per_shape_attention_plans() -> None:
    """Take cuDNN attention out of PyTorch's choice, for the whole process.

    cuDNN attention (PyTorch's first choice on Hopper) builds an execution plan for every new shape,
    which makes a decode step many times slower, and serving makes a new shape nearly every step
    (the span grows by one, the row count changes). Without it PyTorch takes memory-efficient
    attention (flash takes no mask), which plans nothing and runs close to a cached cuDNN plan
    (docs/server.md, "How it works", gives the H200's figures from
    benchmarks/results/step-profile-h200.json). The switch is process-wide because PyTorch's SDPA
    switches are: a per-forward ``sdpa_kernel`` context would race between engines on several GPUs.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


def build_model(spec: ModelSpec) -> TinyGPT:
    """Model on its device, in eval mode: seeded random weights, or a local state-dict checkpoint."""
    device = pick_device(spec)
    if device.type == "cuda":
        avoid_per_shape_attention_plans()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    model = TinyGPT(spec)
    torch.random.set_rng_state(generator_state)
    for name, param in model.named_parameters():
        if name.endswith("weight") and param.dim() == 2:
            with torch.no_grad():
                param.mul_(1.0 / math.sqrt(max(1, spec.layers)))
    if spec.checkpoint:
        state = torch.load(spec.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    return model.to(device=device, dtype=pick_dtype(spec, device)).eval()


class TinyRunner:
    """``ModelRunner`` of ``TinyGPT``: slot rows of its own cache, the byte tokenizer."""

    def __init__(self, model: TinyGPT) -> None:
        self.module = model
        self.device = next(model.parameters()).device
        self.context = model.spec.context
        self.eos_ids = frozenset({EOS})
        self._graph_timer: Any = None  # set by use_cuda_graphs: decode steps replay CUDA graphs
        self.decode_graphs: Any = None
        self._slots = 0

    def use_cuda_graphs(self, timer: Any) -> None:
        """Replay decode steps from CUDA graphs captured per batch size at warm-up
        (``decode_graphs.py``); ``timer`` (a Timer, or the host clock) times their regions."""
        if self.device.type != "cuda":
            raise ValueError("--model.cuda-graphs needs a CUDA device")
        self._graph_timer = timer

    def allocate(self, slots: int) -> None:
        # With graphs, one more slot: the scratch row that padding rows of a captured size write.
        self._slots = slots
        self.module.allocate_cache(slots + (1 if self._graph_timer is not None else 0))

    def tokenize(self, prompt: list[int], add_special_tokens: bool = True) -> list[int]:
        return prompt  # the toy model's tokens are the API's ids: BOS is always there

    def new_decoder(self, prompt: list[int]) -> StreamDecoder:
        return StreamDecoder()

    def prefill(self, slots: list[int], rows: list[list[int]]) -> torch.Tensor:
        width = max(len(row) for row in rows)
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        dev = self.device
        return self.module(tokens.to(dev), torch.tensor(slots, dtype=torch.long, device=dev),
                           torch.zeros(len(rows), dtype=torch.long, device=dev),
                           torch.tensor([len(row) - 1 for row in rows], dtype=torch.long, device=dev), width)

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        # The latency fault's extra MLP passes are not in the captured graphs: run eagerly meanwhile.
        if self.decode_graphs is not None and not self.module.blocks[0].mlp.extra_passes:
            return self.decode_graphs.decode(slots, tokens, positions)
        dev = self.device
        return self.module(torch.tensor(tokens, dtype=torch.long, device=dev)[:, None],
                           torch.tensor(slots, dtype=torch.long, device=dev),
                           torch.tensor(positions, dtype=torch.long, device=dev),
                           torch.zeros(len(slots), dtype=torch.long, device=dev), max(positions) + 1)

    def free(self, slot: int) -> None:
        pass  # a slot's rows are overwritten by its next prefill; the mask never reads past a row's length

    def warm_up(self) -> None:
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        tokens = torch.zeros((1, 4), dtype=torch.long, device=self.device)
        self.module(tokens, slot, slot, slot + 3, 4).float().cpu()
        if self._graph_timer is not None and self.decode_graphs is None:
            self.decode_graphs = DecodeGraphs(self.module, self._graph_timer, self._slots,
                                              scratch_slot=self._slots)

    def set_extra_passes(self, passes: int) -> None:
        self.module.set_extra_passes(passes)

    def instrument(self, timer) -> Any:
        return instrument_model(timer, self.module)


def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Greedy where temperature is 0, else sampled from softmax(logits / temperature)."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperatures.clamp(min=1e-5)[:, None]
    sampled = torch.multinomial(torch.softmax(scaled, dim=-1), 1)[:, 0]
    return torch.where(temperatures > 0, sampled, greedy)
