"""``timer.instrument(model)``: per-module GPU time for a ``torch.nn.Module``.

The chosen submodules' ``forward`` is replaced by a thin wrapper (an instance
attribute) rather than hooked: LIMITS.md measured that empty forward hooks on 24
modules cost 160–410 µs per forward (3–7% of throughput), because a module with
hooks leaves torch's fast call path; a replaced ``forward`` keeps it.

Two modes:

* ``exact`` — each module's region spans exactly its ``forward`` (two records).
* ``partition`` — regions share boundaries (N+1 records for N modules): each
  module's region runs from its start to the next instrumented module's start
  (or the end of the model's forward), so glue between modules (residual adds,
  norms) is charged to the module before it. Nested matches are dropped.
  Sampling is decided per forward pass.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Callable
from typing import Any

from gpuscope.timing.timer import Sequence as RegionSequence
from gpuscope.timing.timer import Timer

#: Module names timed when ``include`` is not given: the usual per-block breakdown.
DEFAULT_NAMES = frozenset({
    "attn", "attention", "self_attn", "self_attention", "mlp", "ffn", "feed_forward", "embed",
    "embedding", "embeddings", "wte", "tok_embeddings", "token_embedding", "lm_head", "head",
})


def _matcher(include: Any) -> Callable[[str, Any], bool]:
    if include is None:
        import torch

        return lambda path, module: path.rsplit(".", 1)[-1] in DEFAULT_NAMES or isinstance(
            module, torch.nn.Embedding | torch.nn.MultiheadAttention)
    if callable(include):
        return include
    if isinstance(include, str):
        include = (include,)
    patterns = tuple(include)

    def match(path: str, module: Any) -> bool:
        last = path.rsplit(".", 1)[-1]
        return any(path == p or last == p or path.endswith("." + p) or fnmatch.fnmatchcase(path, p)
                   for p in patterns)

    return match


class Instrumentation:
    """The wrappers ``instrument`` installed; ``remove()`` restores every ``forward``."""

    def __init__(self, timer: Timer, mode: str) -> None:
        self.timer = timer
        self.mode = mode
        self.ops: list[str] = []
        self._restore: list[tuple[Any, Any]] = []
        self._local = threading.local()

    def sequence(self) -> RegionSequence:
        """This thread's sequence (partition mode)."""
        try:
            return self._local.seq
        except AttributeError:
            seq = self._local.seq = RegionSequence(self.timer, "forward")
            return seq

    def _replace(self, module: Any, forward: Callable) -> None:
        self._restore.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def remove(self) -> None:
        for module, previous in reversed(self._restore):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._restore.clear()


def _exact_forward(timer: Timer, original: Callable, op_name: str) -> Callable:
    record_start, end, op = timer._record_start, timer._end, timer.op_state(op_name)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Timer._begin, inlined: one Python frame less on every module call.
        op.entered += 1
        countdown = op.countdown
        if countdown:
            op.countdown = countdown - 1
            return original(*args, **kwargs)
        op.countdown = op.period - 1
        token = record_start()
        if token is None:
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            end(op, token, None)

    return forward


def _split_forward(inst: Instrumentation, original: Callable, op_name: str) -> Callable:
    op, local, get_seq = inst.timer.op_state(op_name), inst._local, inst.sequence

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            seq = local.seq
        except AttributeError:
            seq = get_seq()
        seq.split(op)
        return original(*args, **kwargs)

    return forward


def _pass_forward(inst: Instrumentation, original: Callable) -> Callable:
    get_seq = inst.sequence

    def forward(*args: Any, **kwargs: Any) -> Any:
        seq = get_seq()
        if seq.active:  # re-entrant call of the model: already inside a pass
            return original(*args, **kwargs)
        seq.begin()
        try:
            return original(*args, **kwargs)
        finally:
            seq.end()

    return forward


def instrument(timer: Timer, model: Any, include: Any = None, *, mode: str = "exact",
               op_name: Callable[[str], str] | None = None) -> Instrumentation:
    """Time the submodules of ``model`` that ``include`` selects.

    Args:
        include: None (``DEFAULT_NAMES`` and embedding/attention module types), module-name
            suffixes or glob patterns over module paths, or ``fn(path, module) -> bool``.
        mode: "exact" or "partition" (module docstring).
        op_name: maps a module path (``blocks.3.attn``) to the op label; default: the path.
    """
    if mode not in ("exact", "partition"):
        raise ValueError(f"mode must be 'exact' or 'partition', got {mode!r}")
    match = _matcher(include)
    name_of = op_name or (lambda path: path)
    chosen: list[tuple[str, Any]] = []
    for path, module in model.named_modules():
        if not path or not match(path, module):
            continue
        if mode == "partition" and any(path.startswith(p + ".") for p, _ in chosen):
            continue
        chosen.append((path, module))
    if not chosen:
        raise ValueError("instrument(): no submodule matched include=" + repr(include))
    inst = Instrumentation(timer, mode)
    for path, module in chosen:
        op = name_of(path)
        inst.ops.append(op)
        if mode == "exact":
            inst._replace(module, _exact_forward(timer, module.forward, op))
        else:
            inst._replace(module, _split_forward(inst, module.forward, op))
    if mode == "partition":
        inst._replace(model, _pass_forward(inst, model.forward))
    return inst


__all__ = ["DEFAULT_NAMES", "Instrumentation", "instrument"]
