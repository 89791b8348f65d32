"""Kernel time per module inside a compiled model's CUDA graphs, from CUPTI's kernel records.

Under ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) a region's time is the GPU
timeline between two event-record nodes of the replayed graph: the kernels' own time plus the gaps
between them (about 1.3 µs per kernel on the H200), so region sums read ~10% above the kernels' time
on a model of many small kernels. Kernel records name no module: a replayed kernel's record carries
only the id of the graph node that launched it. So the nodes are labelled when they are made:

- **At capture.** While the timed graph is captured, the markers in the compiled code run (in
  Python, untraced: ``compiled.CompiledRegions.mark_captured``) and tell ``GraphNodeLabels`` which
  regions are open; CUPTI calls back on every graph node created (``GRAPHNODE_CREATED``), and each
  kernel node created while regions are open is labelled with all of them (a nested region's kernels
  count for its parent too, as its events' span does).
- **At instantiation.** The executable graph's nodes are clones of the captured ones, with ids of
  their own; CUPTI reports each clone (``GRAPHNODE_CLONED``) with its original, and the clone takes
  the original's label.
- **On a sampled replay** (the kernel busy window, ``busy.py``), CUPTI's kernel records give each
  replayed kernel's node id and duration: summed per label, per replay, they are each region's own
  kernel time, ``gpuscope_region_kernel_seconds``; over the region's event time, its busy ratio.

Regions that Inductor fused or reordered into one merged group (``fusion.py``) are reported as that
group, never apart. Nodes created while no region is open (code before the first module or after
the last) and the untimed graph's nodes carry no label: their kernels are left out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable

#: Labelled nodes kept at most (captured nodes and their clones): a model captured for many shapes
#: has a few thousand nodes per shape; past this new nodes go unlabelled and are counted.
MAX_NODES = 1 << 20


class GraphNodeLabels:
    """Which regions (by global region id) each kernel node of a timed graph belongs to."""

    def __init__(self, max_nodes: int = MAX_NODES) -> None:
        self.max_nodes = max_nodes
        #: graph node id → the region ids open when it was created
        self.labels: dict[int, tuple[int, ...]] = {}
        self.unlabelled_full = 0  # nodes not labelled because the table was full
        self.callback_errors = 0  # CUPTI callbacks that could not be read (nothing labelled)
        self._open: list[int] = []
        self._open_label: tuple[int, ...] = ()
        self._capturing_thread: int | None = None
        self._lock = threading.Lock()

    # --- capture (the capturing thread) -----------------------------------------------------

    def mark(self, region: int, is_end: int) -> None:
        """A marker met during capture: region ``region`` opens (``is_end`` 0) or closes (1)."""
        open_ = self._open
        if is_end:
            if region in open_:
                # markers close in nesting order; a region whose start was never met is ignored
                del open_[len(open_) - 1 - open_[::-1].index(region)]
        else:
            open_.append(region)
            self._capturing_thread = threading.get_ident()
        self._open_label = tuple(open_)

    def end_capture(self) -> None:
        """The timed call returned: nothing is open (a pass that raised half-way left regions open)."""
        self._open.clear()
        self._open_label = ()

    def created(self, node_id: int, is_kernel: bool) -> None:
        """CUPTI made a graph node (any thread, any graph): label it if it is a kernel node created
        by the capturing thread while regions are open."""
        label = self._open_label
        if label and is_kernel and threading.get_ident() == self._capturing_thread:
            self._store(node_id, label)

    def cloned(self, node_id: int, original_id: int) -> None:
        """CUPTI cloned a node (graph instantiation): the clone is labelled as its original."""
        label = self.labels.get(original_id)
        if label is not None:
            self._store(node_id, label)

    def _store(self, node_id: int, label: tuple[int, ...]) -> None:
        with self._lock:
            if len(self.labels) >= self.max_nodes:
                self.unlabelled_full += 1
            else:
                self.labels[node_id] = label

    # --- a sampled replay (the resolver thread) -------------------------------------------

    def kernel_ns(self, kernels: Iterable[tuple[int, int]],
                  group_of: Callable[[int], Hashable | None]) -> tuple[dict[Hashable, int], int]:
        """From ``(graph node id, duration ns)`` of the kernels a window recorded: the kernel
        nanoseconds per group per replay, and how many replays the records span (the most records
        any one labelled node has; 0 when no kernel was labelled). ``group_of`` maps a region id to
        what it is reported as (its merged group, or None for a region no longer timed): a kernel
        counts once for each group among its node's open regions."""
        labels = self.labels
        per_node: dict[int, list[int]] = {}
        for node_id, ns in kernels:
            if node_id in labels:
                per_node.setdefault(node_id, []).append(max(0, ns))
        total: dict[Hashable, int] = {}
        replays = 0
        for node_id, durations in per_node.items():
            groups = {group_of(region) for region in labels[node_id]}
            groups.discard(None)
            if not groups:  # another model's node
                continue
            replays = max(replays, len(durations))
            ns = sum(durations)
            for group in groups:
                total[group] = total.get(group, 0) + ns
        if not replays:
            return {}, 0
        return {group: ns // replays for group, ns in total.items()}, replays
