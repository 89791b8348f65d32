"""Which regions of a compiled graph still measure their own module after Inductor's fusion.

A region inside a ``torch.compile``'d model is two marker ops (``compiled.py``) around the module's
ops. Inductor may fuse a module's last kernel with its neighbour's first one, or move a kernel across
a marker when it orders the graph; the events recorded at the markers then no longer bracket
exactly that module's kernels. Rather than report such a number as the module's, the regions involved
are *merged*: reported as one region, from the first member's start to the last member's end, under
the label ``a+b``.

The check runs on the order in which Inductor emits the graph's code (``Scheduler.codegen``, after
fusion and every reordering pass), once per compiled graph:

- each FX node of the graph is owned by the regions whose markers enclose it in the FX graph
  (nested regions: all of them);
- each emitted kernel is owned by the union of the owners of the FX nodes whose values it writes
  (each fused part's ``origin_node``; all its origins where Inductor records none). A pointwise
  producer that Inductor recomputes inside a consumer's kernel is not seen (its work, usually an
  elementwise op or a gather, is charged to the consumer's region);
- a group (one region, or merged ones) spans from its first start marker to its last end marker in
  emission order.

``merge_groups`` then merges until (1) every kernel owned by a region lies inside that region's group
span and (2) no group span holds a kernel owned only by regions outside the group. Kernels owned by
no region (glue between modules: residual adds, norms) may lie inside a span: they are charged to
it, as the eager ``exact`` mode charges work launched inside a module's forward.

``merge_groups`` is a pure function of positions, tested with chosen layouts; ``analyse`` reads them
off Inductor's scheduler nodes (a private API: any failure there is counted, and the graph's regions
are then merged into one, never reported apart).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

log = logging.getLogger("gpuscope.timing")

#: Called with (starts, ends, kernels) of every emitted graph that holds markers.
_listeners: list[Callable[..., None]] = []
_installed = False
_lock = threading.Lock()
#: Graphs whose analysis failed (private Inductor structures changed shape).
analysis_failures = [0]


class Kernel:
    """One emitted kernel: its position in emission order and the regions owning its origin nodes."""

    __slots__ = ("owners", "position")

    def __init__(self, position: int, owners: frozenset[int]) -> None:
        self.position = position
        self.owners = owners


def merge_groups(starts: dict[int, int], ends: dict[int, int], kernels: Sequence[Kernel]) -> list[list[int]]:
    """Groups of regions (each a sorted list of region ids) that measure correctly together.

    ``starts``/``ends``: region id → emission position of its start / end marker (a region missing
    either marker is merged with everything: it cannot be measured); ``kernels``: the emitted kernels.
    """
    regions = sorted(set(starts) | set(ends))
    parent = {r: r for r in regions}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    def union(a: int, b: int) -> bool:
        ra, rb = find(a), find(b)
        if ra == rb:
            return False
        parent[max(ra, rb)] = min(ra, rb)
        return True

    broken = [r for r in regions if r not in starts or r not in ends or starts[r] > ends[r]]
    for r in broken[1:]:
        union(broken[0], r)
    if broken:  # an unmeasurable region: everything in the graph becomes one group
        for r in regions:
            union(broken[0], r)
        return [sorted(regions)] if regions else []

    changed = True
    while changed:
        changed = False
        spans: dict[int, list[int]] = {}
        for r in regions:
            g = find(r)
            span = spans.setdefault(g, [starts[r], ends[r]])
            span[0], span[1] = min(span[0], starts[r]), max(span[1], ends[r])
        for k in kernels:
            p = k.position
            # (1) a kernel of region r outside r's group span: merge every group between them
            for r in k.owners:
                lo, hi = spans[find(r)]
                if lo < p < hi:
                    continue
                a, b = min(lo, p), max(hi, p)
                for g, (glo, ghi) in list(spans.items()):
                    if glo < b and ghi > a:
                        changed |= union(r, g)
            # (2) a span holding a kernel owned only by regions outside its group
            if k.owners:
                for g, (glo, ghi) in spans.items():
                    if glo < p < ghi and not any(find(r) == find(g) for r in k.owners):
                        changed |= union(g, next(iter(k.owners)))
            if changed:
                break
    groups: dict[int, list[int]] = {}
    for r in regions:
        groups.setdefault(find(r), []).append(r)
    return sorted(groups.values())


# --- reading positions off Inductor ------------------------------------------------------------


def _origins(snode: Any) -> Iterable[Any]:
    for node in snode.get_nodes():
        ir_node = getattr(node, "node", None)
        if ir_node is None:
            continue
        origins = getattr(ir_node, "origins", None)
        if origins:
            yield from origins


Positions = tuple[dict[int, int], dict[int, int], list[Kernel]]


def _outputs(snode: Any, order: dict[Any, int], mark_op: Any) -> list[Any]:
    """The FX node whose value each fused part of the kernel writes: its ``origin_node``, or where
    Inductor records none, the part's last origin in graph order. All origins would over-reach: a
    pointwise producer recomputed inside its consumer's kernel (an embedding gather inside the next
    residual add, a mask rebuilt in each attention) lists the producer, tying later kernels to the
    region where it first ran."""
    out: list[Any] = []
    for node in snode.get_nodes():
        ir_node = getattr(node, "node", None)
        if ir_node is None:
            continue
        origin = getattr(ir_node, "origin_node", None)
        if origin is None or origin not in order:
            origins = [o for o in (getattr(ir_node, "origins", None) or ())
                       if o in order and o.target is not mark_op]
            origin = max(origins, key=order.__getitem__) if origins else None
        if origin is not None and origin.target is not mark_op:
            out.append(origin)
    return out


def analyse(snodes: Sequence[Any], mark_op: Any) -> Positions | None:
    """(start positions, end positions, kernels) by region id, or None when no marker is in the
    graph. A marker's slot is 2 × region id, + 1 for the region's end."""
    marker_pos: dict[int, int] = {}  # slot -> emission position
    kernel_positions: list[tuple[int, Any]] = []
    graph = None
    for position, snode in enumerate(snodes):
        marks = [o for o in _origins(snode) if o.target is mark_op]
        if marks and getattr(getattr(snode, "node", None), "op_overload", None) is mark_op:
            marker_pos[int(marks[0].args[1])] = position
            graph = marks[0].graph
            continue
        kernel_positions.append((position, snode))
    if not marker_pos or graph is None:
        return None
    # FX ownership: the regions whose markers enclose each node in the graph's order
    order: dict[Any, int] = {}
    owners_of: dict[Any, frozenset[int]] = {}
    open_regions: set[int] = set()
    for i, node in enumerate(graph.nodes):
        order[node] = i
        if node.op == "call_function" and node.target is mark_op:
            slot = int(node.args[1])
            if slot % 2 == 0:
                open_regions.add(slot // 2)
            else:
                open_regions.discard(slot // 2)
            continue
        if open_regions:
            owners_of[node] = frozenset(open_regions)
    kernels = []
    for position, snode in kernel_positions:
        outputs = _outputs(snode, order, mark_op)
        owners: frozenset[int] = frozenset().union(*(owners_of.get(o, frozenset()) for o in outputs))
        kernels.append(Kernel(position, owners))
    starts = {slot // 2: p for slot, p in marker_pos.items() if slot % 2 == 0}
    ends = {slot // 2: p for slot, p in marker_pos.items() if slot % 2 == 1}
    return starts, ends, kernels


def add_listener(listener: Callable[[dict[int, int], dict[int, int], list[Kernel]], None]) -> None:
    """Call ``listener(starts, ends, kernels)`` (by region id = slot // 2) for every graph Inductor
    emits with markers in it, before its code is generated."""
    with _lock:
        _listeners.append(listener)


def remove_listener(listener: Any) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def install(mark_op: Any) -> bool:
    """Wrap Inductor's ``Scheduler.codegen`` once per process so graphs with markers are analysed.
    False where Inductor's scheduler is not there (then merges cannot be seen: see compiled.py)."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from torch._inductor.scheduler import Scheduler
        except Exception:  # no Inductor in this torch
            return False
        codegen = Scheduler.codegen

        def codegen_with_region_check(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _listeners:
                _notify(self, mark_op)
            return codegen(self, *args, **kwargs)

        codegen_with_region_check.__wrapped__ = codegen  # type: ignore[attr-defined]
        Scheduler.codegen = codegen_with_region_check
        _installed = True
        return True


#: The callable Inductor's Python wrapper code calls at each marker instead of dispatching the op:
#: an attribute of the op's namespace (``torch.ops.gpuscope``), which every emitted module reaches
#: through the ``torch`` it imports, whichever graph or subgraph the marker is in.
DIRECT_ATTR = "region_mark_direct"
_direct_installed = False


def call_directly(mark_op: Any, target: Any) -> bool:
    """Make the Python wrapper code Inductor emits call ``target(x, slot)`` at each marker op, in
    place of ``torch.ops.gpuscope.region_mark.default(x, slot)``: the op's dispatch (a Python
    ``OpOverload`` call, the C++ dispatcher, the Python kernel and its frames) was most of a
    marker's cost. Only the emitted line changes: the op stays in the graph, where ``analyse``
    finds it, and the C++ wrapper (``cpp_wrapper``) still dispatches it. False where Inductor's
    wrapper code generation is not where expected (the emitted code then dispatches the op)."""
    global _direct_installed
    with _lock:
        try:
            import torch
            from torch._inductor.codegen.wrapper import PythonWrapperCodegen
        except Exception:  # no Inductor in this torch
            return False
        setattr(getattr(torch.ops, mark_op.namespace), DIRECT_ATTR, target)
        if _direct_installed:
            return True
        original = getattr(PythonWrapperCodegen, "generate_fallback_kernel", None)
        if original is None:
            return False
        name = f"torch.ops.{mark_op.namespace}.{DIRECT_ATTR}"

        def generate_fallback_kernel(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(node, "op_overload", None) is mark_op:
                line = _direct_line(node, name)
                if line is not None:
                    self.writeline(line)
                    return None
            return original(self, node, *args, **kwargs)

        generate_fallback_kernel.__wrapped__ = original  # type: ignore[attr-defined]
        PythonWrapperCodegen.generate_fallback_kernel = generate_fallback_kernel
        _direct_installed = True
        return True


def calls_directly() -> bool:
    """Whether emitted wrapper code calls the markers directly (``call_directly`` is in place)."""
    return _direct_installed


def _direct_line(node: Any, name: str) -> str | None:
    """``name(x, slot)`` for a marker node, or None to leave the line to Inductor."""
    try:
        from torch._inductor.virtualized import V

        if V.graph.cpp_wrapper:
            return None
        args = node.codegen_args()
    except Exception:
        return None
    if len(args) != 2:
        return None
    return f"{name}({args[0]}, {args[1]})"


def _notify(scheduler: Any, mark_op: Any) -> None:
    try:
        found = analyse(list(scheduler.nodes), mark_op)
    except Exception as exc:  # never break the user's compile
        analysis_failures[0] += 1
        log.warning("gpuscope: cannot read region boundaries off this compiled graph (%r); its "
                    "regions are reported merged", exc)
        found = _markers_only(scheduler, mark_op)
    if found is None:
        return
    for listener in list(_listeners):
        try:
            listener(*found)
        except Exception:
            analysis_failures[0] += 1
            log.exception("gpuscope: region analysis listener failed")


def _markers_only(scheduler: Any, mark_op: Any) -> Positions | None:
    """After a failed analysis: the graph's regions, each missing its start, so that
    ``merge_groups`` merges them all."""
    regions: dict[int, int] = {}
    try:
        for snode in scheduler.nodes:
            for origin in _origins(snode):
                if origin.target is mark_op:
                    regions[int(origin.args[1]) // 2] = 0
    except Exception:
        return None
    return ({}, regions, []) if regions else None
