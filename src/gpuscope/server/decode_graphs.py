"""``--model.cuda-graphs``: the toy model's decode step replayed from CUDA graphs, one per batch size.

As vLLM and SGLang do, the decode step is captured once per batch size (1, 2, 4, ... up to the
engine's batch) with static input buffers; a step with fewer rows pads up to the next captured size
(padding rows write to a scratch cache slot nobody reads). The attention span is the model's whole
context, masked by position, so one graph serves every step of a size. With a ``Timer``, each size
is a ``TimedGraph``: its per-module regions are timed on sampled replays from event nodes inside
the graph (gpuscope.timing.graphs), within the timer's budget. With ``--timing off`` the graphs
are plain ``torch.cuda.CUDAGraph``s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpuscope.timing.graphs import TorchGraphs

if TYPE_CHECKING:
    from .model import TinyGPT


def capture_sizes(batch_size: int) -> list[int]:
    """1, 2, 4, ... and ``batch_size`` itself: every step pads to the smallest size that fits."""
    sizes, size = [], 1
    while size < batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, batch_size]


class _PlainGraph:
    """A ``torch.cuda.CUDAGraph`` of ``step`` behind the same ``replay()`` as ``TimedGraph``."""

    def __init__(self, graphs: TorchGraphs, step: Any) -> None:
        graphs.warm_up(step, 2)
        self._graph, self._output = graphs.capture(step)

    def replay(self) -> torch.Tensor:
        self._graph.replay()
        return self._output


class DecodeGraphs:
    """Replays ``model``'s decode step for any row count up to ``batch_size``.

    ``scratch_slot`` is a cache slot no request uses (the runner allocates one extra).
    """

    def __init__(self, model: TinyGPT, timer: Any, batch_size: int, scratch_slot: int) -> None:
        device = next(model.parameters()).device
        self.sizes = capture_sizes(batch_size)
        self.scratch_slot = scratch_slot
        self.context = model.spec.context
        graphs = TorchGraphs()  # one memory pool for every size: one replay runs at a time
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._graphs: dict[int, Any] = {}
        timed = hasattr(timer, "graph")  # a gpuscope Timer; the host clock of --timing off is not
        for size in self.sizes:
            tokens = torch.zeros((size, 1), dtype=torch.long, device=device)
            slots = torch.full((size,), scratch_slot, dtype=torch.long, device=device)
            start = torch.zeros(size, dtype=torch.long, device=device)
            last = torch.zeros(size, dtype=torch.long, device=device)
            self._inputs[size] = (tokens, slots, start, last)

            def step(tokens=tokens, slots=slots, start=start, last=last) -> torch.Tensor:
                return model(tokens, slots, start, last, self.context)

            self._graphs[size] = (timer.graph(step, graphs=graphs) if timed
                                  else _PlainGraph(graphs, step))

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step, valid until the next replay."""
        rows = len(slots)
        size = next(s for s in self.sizes if s >= rows)
        pad = size - rows
        static_tokens, static_slots, static_start, _ = self._inputs[size]
        static_tokens.copy_(torch.tensor([*tokens, *[0] * pad], dtype=torch.long).view(size, 1))
        static_slots.copy_(torch.tensor([*slots, *[self.scratch_slot] * pad], dtype=torch.long))
        static_start.copy_(torch.tensor([*positions, *[0] * pad], dtype=torch.long))
        return self._graphs[size].replay()[:rows]

    def timed_graphs(self) -> list[Any]:
        return [g for g in self._graphs.values() if hasattr(g, "timed_replays")]
