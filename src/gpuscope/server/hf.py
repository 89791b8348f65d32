"""``--model.hf DIR``: a local Hugging Face causal LM as the engine's ``ModelRunner``.

Loads any ``AutoModelForCausalLM`` and its tokenizer from a folder on disk
(``local_files_only=True``: never a hub download; no ``trust_remote_code``).

KV cache: the model's own ``transformers.DynamicCache``, one for the decode
batch. Its rows are requests, **left-padded** so every row's newest token sits
in the last column and one decode step appends one column to all rows. Each
row's real tokens have position ids ``0..n-1`` and a 2D attention mask hides
its padding, so a row computes what it would alone (tested: batched greedy
output equals unbatched, token for token).

- ``prefill`` runs the newcomers as one left-padded batch into a fresh cache
  (padding columns' keys/values zeroed) and keeps it aside;
- the next ``decode`` first folds those caches into the batch cache (padding
  the shorter side on the left), drops rows of finished requests, trims
  columns that are padding in every row, then runs one token per row;
- ``free`` only marks a row dead, so requests that finish together cost one
  compaction.

Timing: ``module_paths`` picks what ``timer.instrument`` times, by structure
rather than by one architecture's names: the input embedding
(``get_input_embeddings()``), every attention module (last name ``self_attn``,
``attn``, ``self_attention`` or ``attention``), every MLP (``mlp``,
``feed_forward`` or ``block_sparse_moe``) and the LM head
(``get_output_embeddings()``), outermost match only. Op labels are the module
paths, e.g. Llama/Mistral/Qwen2: ``model.embed_tokens``,
``model.layers.N.self_attn``, ``model.layers.N.mlp``, ``lm_head``; GPT-2:
``transformer.wte``, ``transformer.h.N.attn``, ``transformer.h.N.mlp``,
``lm_head``.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from .config import ConfigError, ModelSpec
from .model import BOS, avoid_per_shape_attention_plans, pick_device, pick_dtype

log = logging.getLogger("gpuscope.server")

#: Last names of the attention and MLP modules timed per decoder layer (see the module docstring).
ATTENTION_NAMES = ("self_attn", "attn", "self_attention", "attention")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
#: Prompt tokens a detokenizer starts from, so the first generated token decodes in context
#: (SentencePiece drops a leading space at the start of what it decodes).
DECODER_CONTEXT = 6


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return (text[: limit - 1] + "…" if len(text) > limit else text) or type(exc).__name__


def module_paths(model: torch.nn.Module) -> list[str]:
    """Module paths to time: input embedding, attention and MLP of each layer, LM head (outermost only)."""
    ends = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    chosen: list[str] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(p + ".") for p in chosen):
            continue
        last = path.rsplit(".", 1)[-1]
        if id(module) in ends or last in ATTENTION_NAMES or last in MLP_NAMES:
            chosen.append(path)
    return chosen


class HFStreamDecoder:
    """Token ids → text, one token at a time, with the model's tokenizer.

    Decodes a short window twice per token and emits only what the newer decode adds, holding it back
    while it ends in U+FFFD (a character split across byte tokens), so the pieces add up to the
    full decode and multi-token characters and SentencePiece word spaces come out whole.
    """

    def __init__(self, tokenizer: Any, prompt: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt[-DECODER_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def _text(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)

    def _new_text(self, final: bool) -> str:
        before = self._text(self._prefix, self._read)
        after = self._text(self._prefix)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def feed(self, token: int) -> str:
        self._ids.append(token)
        return self._new_text(final=False)

    def finish(self) -> str:
        return self._new_text(final=True)


@dataclass(eq=False)
class _Rows:
    """Requests sharing one left-padded cache: ``slots[i]`` is row i's slot, None once freed."""

    slots: list[int | None]
    cache: Any
    width: int  # cache columns
    lengths: list[int] = field(default_factory=list)  # real tokens per row (the rest is left padding)

    def live(self) -> list[int]:
        return [s for s in self.slots if s is not None]


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer: [rows, kv_heads, columns, head_dim]."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.54: cache layer objects
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _set_layers(cache: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    layers = getattr(cache, "layers", None)
    for i, (k, v) in enumerate(kv):
        if layers is not None:
            layers[i].keys, layers[i].values = k, v
        else:
            cache.key_cache[i], cache.value_cache[i] = k, v


def _first_id(*ids: int | None) -> int:
    return next((t for t in ids if t is not None), 0)


class HFRunner:
    """``ModelRunner`` over a Hugging Face causal LM and its ``DynamicCache`` (module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, context: int,
                 eos_ids: frozenset[int]) -> None:
        from transformers import DynamicCache

        self.module = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.context = context
        self.eos_ids = eos_ids
        self._new_cache = DynamicCache
        params = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self._keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None)
        self._pad_id = _first_id(tokenizer.pad_token_id, tokenizer.eos_token_id)  # any id: masked, zeroed
        self._start_id = _first_id(tokenizer.bos_token_id, tokenizer.eos_token_id)  # for an empty prompt
        self.paths = module_paths(model)
        named = dict(model.named_modules())
        self._mlps = [named[p] for p in self.paths if p.rsplit(".", 1)[-1] in MLP_NAMES]
        self._spike_hooks: list[Any] = []
        self._batch: _Rows | None = None
        self._pending: list[_Rows] = []

    # --- tokens ----------------------------------------------------------------
    def allocate(self, slots: int) -> None:
        pass  # DynamicCache grows with the batch

    def tokenize(self, prompt: list[int], add_special_tokens: bool = True) -> list[int]:
        if not prompt or prompt[0] != BOS:
            raise ValueError("prompt ids must be BOS followed by UTF-8 bytes")
        text = bytes(prompt[1:]).decode("utf-8")  # ValueError (UnicodeDecodeError too) on bad ids
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return ids or [self._start_id]

    def new_decoder(self, prompt: list[int]) -> HFStreamDecoder:
        return HFStreamDecoder(self.tokenizer, prompt)

    # --- steps -----------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                 cache: Any) -> torch.Tensor:
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                  self._cache_arg: cache, "use_cache": True}
        if self._keep_arg is not None:
            kwargs[self._keep_arg] = 1
        return self.module(**kwargs).logits[:, -1]

    def prefill(self, slots: list[int], rows: list[list[int]]) -> torch.Tensor:
        dev = self.device
        width = max(len(row) for row in rows)
        pads = [width - len(row) for row in rows]
        ids = torch.tensor([[self._pad_id] * pad + row for pad, row in zip(pads, rows, strict=True)],
                           dtype=torch.long).to(dev)
        pad_t = torch.tensor(pads, dtype=torch.long).to(dev)
        columns = torch.arange(width, device=dev)[None, :]
        real = columns >= pad_t[:, None]
        positions = (columns - pad_t[:, None]).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(ids, real.long() if any(pads) else None, positions, cache)
        if any(pads):  # garbage (even NaN) in padding columns must never meet a zero attention weight
            hidden = ~real[:, None, :, None]
            for k, v in _layers(cache):
                k.masked_fill_(hidden, 0)
                v.masked_fill_(hidden, 0)
        self._pending.append(_Rows(list(slots), cache, width, [len(row) for row in rows]))
        return logits

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        try:
            batch = self._gather(set(slots))
            dev = self.device
            row_of = {s: i for i, s in enumerate(batch.slots)}
            order = [row_of[s] for s in slots]
            ids = [0] * len(order)
            for s, token, position in zip(slots, tokens, positions, strict=True):
                i = row_of[s]
                if batch.lengths[i] != position:
                    raise RuntimeError(f"slot {s} holds {batch.lengths[i]} tokens, decode asked for position "
                                       f"{position}")
                ids[i] = token
            pads = [batch.width - n for n in batch.lengths]
            ids_t = torch.tensor(ids, dtype=torch.long).to(dev)[:, None]
            pos_t = torch.tensor(batch.lengths, dtype=torch.long).to(dev)[:, None]
            mask = None
            if any(pads):
                pad_t = torch.tensor(pads, dtype=torch.long).to(dev)
                mask = (torch.arange(batch.width + 1, device=dev)[None, :] >= pad_t[:, None]).long()
            logits = self._forward(ids_t, mask, pos_t, batch.cache)
            batch.width += 1
            batch.lengths = [n + 1 for n in batch.lengths]
        except Exception:
            # A failed step leaves the cache half-updated; the engine fails every running request.
            self._batch, self._pending = None, []
            raise
        if order != list(range(len(order))):
            logits = logits[torch.tensor(order, device=logits.device)]
        return logits

    def _gather(self, wanted: set[int]) -> _Rows:
        """The batch cache holding exactly ``wanted``: dead rows dropped, waiting prefills folded in."""
        joining = [g for g in self._pending if set(g.live()) & wanted]
        self._pending = [g for g in self._pending if g not in joining]
        groups = [g for g in (self._batch, *joining) if g is not None]
        single = len(groups) == 1 and None not in groups[0].slots
        batch = groups[0] if single else self._merge(groups)
        self._batch = batch
        if set(batch.live()) != wanted or len(batch.live()) != len(wanted):
            raise RuntimeError(f"decode of slots {sorted(wanted)} but the cache holds {sorted(batch.live())}")
        return batch

    def _merge(self, groups: list[_Rows]) -> _Rows:
        width = 0
        parts: list[tuple[_Rows, torch.Tensor | None, int]] = []  # group, rows kept, columns trimmed
        slots: list[int | None] = []
        lengths: list[int] = []
        for g in groups:
            keep = [i for i, s in enumerate(g.slots) if s is not None]
            if not keep:
                continue
            trim = min(g.width - g.lengths[i] for i in keep)  # columns that are padding in every kept row
            index = None if len(keep) == len(g.slots) else torch.tensor(keep, device=self.device)
            parts.append((g, index, trim))
            slots += [g.slots[i] for i in keep]
            lengths += [g.lengths[i] for i in keep]
            width = max(width, g.width - trim)
        if not parts:
            raise RuntimeError("decode with no live rows")
        layers = [_layers(g.cache) for g, _, _ in parts]
        merged = []
        for n in range(len(layers[0])):
            keys, values = [], []
            for (g, index, trim), kv in zip(parts, layers, strict=True):
                k, v = kv[n]
                if index is not None:
                    k, v = k[index], v[index]
                left = width - (g.width - trim)
                k, v = k[:, :, trim:], v[:, :, trim:]
                if left:
                    k, v = F.pad(k, (0, 0, left, 0)), F.pad(v, (0, 0, left, 0))
                keys.append(k)
                values.append(v)
            merged.append((torch.cat(keys) if len(keys) > 1 else keys[0].contiguous(),
                           torch.cat(values) if len(values) > 1 else values[0].contiguous()))
        cache = parts[0][0].cache
        _set_layers(cache, merged)
        return _Rows(slots, cache, width, lengths)

    def free(self, slot: int) -> None:
        for group in (self._batch, *self._pending):
            if group is not None and slot in group.slots:
                group.slots[group.slots.index(slot)] = None
                if not group.live():
                    if group is self._batch:
                        self._batch = None
                    else:
                        self._pending.remove(group)
                return

    def warm_up(self) -> None:
        """Two rows of different lengths through prefill and two decode steps, then freed."""
        slots = [-1, -2]
        start = self._start_id
        self.prefill(slots, [[start] * 4, [start] * 2])
        for step in range(2):
            self.decode(slots, [start, start], [4 + step, 2 + step]).float().cpu()
        for slot in slots:
            self.free(slot)

    # --- faults and timing -----------------------------------------------------
    def set_extra_passes(self, passes: int) -> None:
        """latency_spike: each weight-bearing child of every MLP runs ``passes`` more times, in the MLP."""
        for hook in self._spike_hooks:
            hook.remove()
        self._spike_hooks = []
        if passes <= 0:
            return

        def repeat(module, args, kwargs, output):
            for _ in range(passes):
                module.forward(*args, **kwargs)

        for mlp in self._mlps:
            for child in mlp.children():
                if any(p.dim() == 2 for p in child.parameters(recurse=False)):
                    self._spike_hooks.append(child.register_forward_hook(repeat, with_kwargs=True))

    def instrument(self, timer) -> Any:
        chosen = set(self.paths)
        return timer.instrument(self.module, include=lambda path, module: path in chosen)


def _eos_ids(tokenizer: Any, model: torch.nn.Module) -> frozenset[int]:
    """The tokenizer's eos_token_id, plus the generation config's (a list for some chat models)."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(generation, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_runner(spec: ModelSpec) -> HFRunner:
    """The model and tokenizer in ``spec.hf``, on ``spec.device`` in ``spec.dtype``.

    ConfigError (one line) when the folder is not a loadable causal LM with a tokenizer, or when
    ``--model.context`` exceeds the model's positions.
    """
    path = spec.hf
    assert path is not None
    spec.validate()  # the folder and its config.json exist
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ConfigError("--model.hf needs transformers and tokenizers: "
                          "pip install 'gpuscope[hf]'") from None
    transformers.utils.logging.disable_progress_bar()
    where = f"--model.hf {path!r}"
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{where} is not a Hugging Face model folder: {_one_line(exc)}") from None
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and spec.context > positions:
        raise ConfigError(f"--model.context {spec.context} is more than the model's {positions} positions "
                          "(max_position_embeddings)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{where} has no usable tokenizer: {_one_line(exc)}") from None
    device = pick_device(spec)
    dtype = pick_dtype(spec, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **{_dtype_kwarg(): dtype})
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{where} is not a loadable causal LM: {_one_line(exc)}") from None
    if device.type == "cuda":
        avoid_per_shape_attention_plans()
    model = model.to(device=device, dtype=dtype).eval()
    eos = _eos_ids(tokenizer, model)
    if not eos:
        log.warning("%s: the tokenizer has no eos_token_id; requests end at max_tokens only", where)
    runner = HFRunner(model, tokenizer, spec.context, eos)
    log.info("loaded %s (%s, %d parameters, %s on %s); timing %d modules", path, type(model).__name__,
             sum(p.numel() for p in model.parameters()), str(dtype).removeprefix("torch."), device,
             len(runner.paths))
    return runner
