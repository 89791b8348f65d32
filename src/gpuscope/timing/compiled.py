"""``instrument()`` on ``torch.compile``'d models: per-module regions that dynamo traces through.

The eager design (instrument.py) swaps per-module wrappers in and out of ``module.__dict__`` on
sampled passes and reads a clock; inside a compiled region dynamo cannot trace either, so each
became a graph break (and, under ``mode="reduce-overhead"``, a split CUDA graph). Here:

- **Sampling is decided outside the compiled call.** The callable the user calls (an
  ``OptimizedModule``'s ``forward``, a module's ``_compiled_call_impl`` after ``module.compile()``, or
  the instance ``__call__`` that ``torch.compile(model)`` picks up when ``instrument`` came first) is
  replaced by ``pass_call``: a frame dynamo skips (``torch._dynamo.skip``), which counts the pass,
  decides whether it is timed, and calls the compiled model.
- **Region boundaries are ops in the graph.** Each instrumented module's ``forward`` is wrapped,
  once and for good, by a function dynamo inlines: when ``regions.timed`` is set it calls the
  custom op ``gpuscope::region_mark(x, slot)`` on the module's first input tensor and on its first
  output tensor. Dynamo guards on ``regions.timed``, so the model compiles twice: an untimed graph
  with no marker at all, and a timed twin. Inductor keeps the markers (registered as side-effectful)
  as extern calls in place; ``fusion.py`` checks, on the code Inductor emits, which regions still
  bracket only their own kernels and merges the others (``a+b``), never reporting them apart.
- **A marker either records an event now or becomes a graph node.** Where the compiled code runs
  from Python (default ``torch.compile``, and CUDA graph trees' warm-up runs) the marker pops an
  event from the timer's pool and records it, as ``timer.start``/``stop`` do. Under CUDA graph
  capture (``mode="reduce-overhead"``) it records one of this shape's preallocated events as an
  external event-record node (as ``timer.graph()`` does), so every replay of the timed graph
  re-records it on the GPU with no Python. After a timed call whose graph was replayed, ``pass_call``
  records a fence; the resolver reads the pairs once it completes and only then lets the timed graph
  run again (meanwhile sampled passes run untimed and count ``graph_busy``).
- **Markers that touch share one event.** Where no kernel is emitted between two markers (a region's
  end and the next region's start, a nested region's end and its parent's), decided per graph from
  the positions fusion.py reports (``_touching``), the later marker reuses the earlier one's event:
  on the default-compile path only after an end (its event is kept, ``keep_end``, for the pair that
  reuses it, as a sequence's boundary is: hot.py), under capture after any marker (one event node).

Per pass that is not timed: one Python frame, a countdown and the dynamo guard on ``timed``.
A timed pass costs two marker calls per region from Inductor's Python wrapper code (default compile;
with the C extension each is one C call, ``region_mark``, which the emitted code calls directly:
``fusion.call_directly``) and up to two event records per region (N + 1 for a chain of N regions
that touch), or up to two event nodes per region on the GPU (reduce-overhead); the overhead budget
sets how often (``budget.py``).

One thread at a time per compiled model: markers run only for the thread whose pass is timed (a
marker reached from another thread is counted in ``stray_marks`` and does nothing).
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuscope.timing import fusion, hot
from gpuscope.timing.core import Pending
from gpuscope.timing.graphs import GraphRecorder, GraphReplay, TorchGraphs

if TYPE_CHECKING:
    from gpuscope.timing.instrument import Instrumentation

log = logging.getLogger("gpuscope.timing")

MARK_OP_NAME = "gpuscope::region_mark"
#: Input shapes whose timed graphs get their own preallocated event nodes (a model served at a
#: handful of batch sizes has a handful); passes of further shapes run untimed under CUDA graphs.
MAX_GRAPH_SHAPES = 16
#: Graphs whose marker layouts a compiled model follows to decide which markers share an event;
#: past that (a model recompiled for many shapes) no marker shares.
MAX_LAYOUTS = 64
#: Timed calls of a new input shape compiled with Inductor's caches off: a graph loaded from a
#: cache skips the code generation where region merges are checked (fusion.py).
UNCACHED_TIMED_CALLS = 3
#: Input shapes whose timed calls are counted for that; a shape past them is taken as compiled
#: (a model served at many shapes under dynamic shapes compiles once for all of them). Not counted,
#: every timed pass of a model on the CPU host, or of a shape past ``MAX_GRAPH_SHAPES``, turned the
#: caches off and on again: about 43 µs a timed pass on the CPU host (compile_host_cpu_bench.py).
MAX_COUNTED_SHAPES = 1024
#: Under default compile, sampled passes come in runs of up to this many in a row (the sampling rate
#: unchanged): the first timed pass after untimed ones, and the first untimed one after it, pay for
#: the switch between the two compiled graphs (dynamo's cache entry that fails its guard first, and
#: the other graph's code and buffers gone cold): on the CPU host about 200 µs a switch, against
#: 28 µs for a timed pass's own work (docs/design.md, "Runs of timed passes"). Under CUDA graphs a
#: timed graph runs again only once its last replay was read, so there a run is one pass.
TIMED_RUN = 8
#: Under default torch.compile on a GPU, how much more a timed pass costs than the launching thread's
#: CPU shows (``Instrumentation.sampled_pass_cost_s``, what the budget charges). In short alternating
#: blocks against the same model detached on an H100 (docs/design.md, "The default budget in fine
#: blocks"), the budget cost 1.56, 1.22, 2.62 and 1.73% (encoder, one-token Llama, prefill, ResNet-50)
#: where its estimate read 0.66, 0.81, 1.01 and 0.70%: 2.4, 1.5, 2.6 and 2.5 times. The largest is
#: taken, until a clock that sees the whole cost (``wall_cost``, ``step_cost``) is shown to track it.
#: Under CUDA graph trees a timed replay costs event nodes on the GPU, which the estimate did not
#: miss (0.00-0.20% at the budget), and on the host route the thread's CPU is the cost.
UNSEEN_COST_FACTOR = 2.6
#: A measured pass's step (``Instrumentation.step_cost``): which mean it goes to, and the longest one
#: taken for the pass's, in untimed steps (once MIN_STEPS_FOR_GAPS of them are averaged); a longer
#: one is the program idle between requests.
STEP_SAMPLED, STEP_UNSAMPLED, STEP_AFTER = 1, 2, 3
STEP_GAP_FACTOR, MIN_STEPS_FOR_GAPS = 4, 8

_lock = threading.Lock()
#: region id → (CompiledRegions, index, its markers) ; a marker's slot is 2 × region id (+1 for the end)
_regions: list[tuple[Any, int, Any] | None] = []
_op: Any = None
_fusion_hooked = False


def mark_op() -> Any:
    """The marker op (registered once per process) ``gpuscope::region_mark(Tensor x, int slot) -> ()``."""
    global _op, _fusion_hooked
    with _lock:
        if _op is not None:
            return _op
        import torch
        from torch.fx.node import _side_effectful_functions

        lib = torch.library.Library("gpuscope", "FRAGMENT")
        lib.define("region_mark(Tensor x, int slot) -> ()")
        lib.impl("region_mark", _mark_impl, "CompositeExplicitAutograd")
        torch.library.register_fake(MARK_OP_NAME, _mark_fake, lib=lib)
        op = torch.ops.gpuscope.region_mark.default
        # A graph's dead-code elimination (FX's, AOT's, Inductor's) keeps impure ops only.
        _side_effectful_functions.add(op)
        _mark_op_lib.append(lib)
        _fusion_hooked = fusion.install(op)
        fusion.call_directly(op, region_mark)
        if not _fusion_hooked:
            log.warning("gpuscope: Inductor's scheduler is not where expected: regions in compiled "
                        "graphs cannot be checked for fusion and are reported per graph, merged")
        fusion.add_listener(_on_graph)
        _op = op
        return op


_mark_op_lib: list[Any] = []  # keeps the library (and its registrations) alive


def _mark_fake(x: Any, slot: int) -> None:
    return None


def _mark_impl(x: Any, slot: int) -> None:
    """The marker in Python: the op's kernel (where Inductor's code dispatches the op, e.g. a torch
    whose wrapper code fusion.py cannot rewrite) and ``region_mark`` without the C extension."""
    entry = _regions[slot >> 1] if (slot >> 1) < len(_regions) else None
    if entry is None:
        return
    regions, index, marks = entry
    setter = _set_eval_frame
    callback = setter(None) if setter is not None else None  # the timer's Python is never traced
    try:
        marks.mark(index, slot & 1)
    except Exception:  # observability never breaks the observed program
        regions.core.dropped["error"] += 1
    finally:
        if setter is not None:
            setter(callback)


def _mark_captured(regions: CompiledRegions, index: int, is_end: int) -> None:
    """A marker met while its CUDA graph is captured (from the C markers: Python runs untraced)."""
    setter = _set_eval_frame
    callback = setter(None) if setter is not None else None
    try:
        regions.mark_captured(index, is_end)
    finally:
        if setter is not None:
            setter(callback)


def _on_graph(starts: dict[int, int], ends: dict[int, int], kernels: list[fusion.Kernel]) -> None:
    """fusion.py's report on one emitted graph: hand each instrumentation its regions' groups."""
    groups = fusion.merge_groups(starts, ends, kernels)
    by_owner: dict[int, tuple[Any, list[list[int]]]] = {}
    positions: dict[int, dict[int, tuple[int, int]]] = {}
    for group in groups:
        members = [(r, _regions[r]) for r in group if r < len(_regions) and _regions[r] is not None]
        if not members:
            continue
        owner = members[0][1][0]
        # regions of two instrumentations never merge with each other's: each keeps its own
        by_owner.setdefault(id(owner), (owner, []))[1].append(
            [entry[1] for _, entry in members if entry[0] is owner])
        for r, (regions, index, _) in members:
            if r in starts and r in ends:
                positions.setdefault(id(regions), {})[index] = (starts[r], ends[r])
    # where each marker sits: (emission position, kernels emitted before it); two markers with
    # the same count have no kernel between them and may share one event
    kernel_positions = sorted(k.position for k in kernels)
    layouts: dict[int, dict[tuple[int, int], tuple[int, int]]] = {}
    # none where a region misses a marker (e.g. after a failed analysis: fusion._markers_only)
    complete = starts.keys() == ends.keys()
    for is_end, where in ((0, starts), (1, ends)) if complete else ():
        for r, position in where.items():
            entry = _regions[r] if r < len(_regions) else None
            if entry is not None:
                layouts.setdefault(id(entry[0]), {})[(entry[1], is_end)] = (
                    position, bisect.bisect_left(kernel_positions, position))
    for key, (owner, owner_groups) in by_owner.items():
        owner.add_graph(owner_groups, positions.get(key, {}), layouts.get(key))


# --- which callable is the compiled one ---------------------------------------------------------


def compiled_target(model: Any) -> tuple[str, Any] | None:
    """("optimized", the OptimizedModule) or ("inplace", the module compiled with ``.compile()``),
    or None for a model that is not compiled."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:
        return None
    if isinstance(model, OptimizedModule):
        return ("optimized", model)
    if model.__dict__.get("_compiled_call_impl") is not None:
        return ("inplace", model)
    return None


def skip_frame(fn: Callable) -> Callable:
    """``fn``'s own frame is never traced by dynamo (the frames it calls are, unless it runs them
    under ``untraced``)."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except Exception:  # a torch without dynamo: nothing to skip
        return fn
    skip_code(fn.__code__)
    return fn


def _eval_frame_setter() -> Callable[[Any], Any] | None:
    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
    except Exception:
        return None
    return set_eval_frame


def _run_with(callback: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with dynamo's frame callback set back to ``callback`` (the compiled
    model's own call must be seen by dynamo; the timer's bookkeeping around it must not)."""
    setter = _set_eval_frame
    if setter is None:
        return fn(*args, **kwargs)
    previous = setter(callback)
    try:
        return fn(*args, **kwargs)
    finally:
        setter(previous)


_set_eval_frame = _eval_frame_setter()


def untraced(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` with dynamo's frame callback off."""
    return _run_with(None, fn, args, {})


def dynamo_active() -> bool:
    """Whether dynamo's frame callback is set on this thread (a compiled call is running)."""
    setter = _set_eval_frame
    if setter is None:
        return False
    callback = setter(None)
    setter(callback)
    return callback is not None


_run_with = skip_frame(_run_with)
untraced = skip_frame(untraced)
dynamo_active = skip_frame(dynamo_active)
_mark_impl = skip_frame(_mark_impl)
_mark_captured = skip_frame(_mark_captured)
#: What Inductor's Python wrapper code calls at each marker, ``region_mark(x, slot)`` (fusion.py
#: rewrites the line it emits for the op): with the C extension one C call, which runs the
#: region's markers (``hot.region_marks``) with no op dispatch and no Python frame.
region_mark = hot.mark_table(_regions, _mark_impl)


# --- the traced per-module wrapper ------------------------------------------------------------


def _first_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    elif isinstance(value, dict):
        for item in value.values():
            if isinstance(item, torch.Tensor):
                return item
    return None


def traced_forward(regions: CompiledRegions, index: int, original: Callable) -> Callable:
    """The module's ``forward`` as dynamo sees it: markers around it on timed passes only."""
    import torch

    op = mark_op()
    start_slot, end_slot = regions.slots[index]
    is_compiling = torch.compiler.is_compiling

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not is_compiling() or not regions.timed:  # an eager call, or the untimed graph
            return original(*args, **kwargs)
        x = _first_tensor(args) if args else _first_tensor(kwargs)
        if x is not None:
            op(x, start_slot)
        out = original(*args, **kwargs)
        y = _first_tensor(out)
        if y is not None:
            op(y, end_slot)
        return out

    return forward


# --- per-shape graph events ---------------------------------------------------------------------


class ShapeGraphs:
    """The event nodes of the timed graphs captured for one input shape, and their reading state
    (the owner ``GraphReplay.read`` expects: ``baseline_s``, ``replays``, ``counted_replays``)."""

    def __init__(self, regions: CompiledRegions, device: int) -> None:
        self.regions = regions
        self.recorder = GraphRecorder(regions.core, device, 2 * len(regions.names) + 2)
        self.replay = GraphReplay(self, self.recorder, None, None)
        self.events: dict[tuple[int, int], Any] = {}  # (index, is_end) → event node
        self.last: tuple[tuple[int, int], int, Any] | None = None  # the last marker met, its stream and node
        self.replayed = False  # the last timed call replayed the captured graph (no eager markers)
        self.replays = self.counted_replays = 0  # entered counts are kept by pass_call
        self.baseline_s: float | None = None
        self.retired: list[GraphRecorder] = []

    def take(self, index: int, is_end: int, stream: int) -> None:
        """A marker met while its graph is captured: an event node for this (index, end), or the
        node of the marker just before it where no kernel lies between them (``capture_reuse``)."""
        key = (index, is_end)
        if key in self.events:
            # re-captured (CUDA graph trees record again, e.g. after a new path): fresh events
            self.retired.append(self.recorder)
            self.recorder = GraphRecorder(self.regions.core, self.recorder.device, len(self.recorder.events))
            self.replay = GraphReplay(self, self.recorder, None, None)
            self.events = {}
            self.last = None
        last = self.last
        if last is not None and self.regions.capture_reuse.get(key) == last[0] and last[1] == stream:
            self.events[key] = last[2]
            self.last = (key, stream, last[2])
            return
        event = self.recorder.take(stream)
        if event is not None:
            self.events[key] = event
            self.last = (key, stream, event)
        else:
            self.last = None

    @property
    def nodes(self) -> int:
        """Event-record nodes in the captured timed graph."""
        return len({id(event) for event in self.events.values()})

    def pairs(self) -> list[tuple[Any, Any, Any]]:
        events, out = self.events, []
        for first, last, op in self.regions.group_bounds():
            start, end = events.get((first, 0)), events.get((last, 1))
            if start is not None and end is not None:
                out.append((op, start, end))
        return out

    def destroy(self) -> None:
        for recorder in (self.recorder, *self.retired):
            recorder.destroy()


# --- the regions of one instrumentation ------------------------------------------------------


class CompiledRegions:
    """The markers, merge groups and per-pass state of one instrumented compiled model."""

    def __init__(self, inst: Instrumentation, names: list[str], op_states: list[Any]) -> None:
        mark_op()
        self.inst = inst
        self.core = inst.core
        self.names = names
        self.ops = op_states
        #: read by the traced wrappers: dynamo guards on it, so timed and untimed graphs differ
        self.timed = False
        #: what each marker does (C: hot.region_marks); armed for the thread of a timed pass
        self.marks = hot.region_marks(self.core, len(names), functools.partial(_mark_captured, self))
        #: whether the last timed pass before the current run recorded its marks as it ran (default
        #: torch.compile) rather than as nodes of a replayed graph; read by the budget's thread, which
        #: must not see the marks' count reset at the start of a timed pass
        self.ran_eagerly = False
        self.slots: list[tuple[int, int]] = []
        with _lock:
            for index in range(len(names)):
                region = len(_regions)
                _regions.append((self, index, self.marks))
                self.slots.append((2 * region, 2 * region + 1))
        self._region_ids = {start // 2: i for i, (start, _) in enumerate(self.slots)}
        # groups: each a list of indices; the default is every region on its own
        self._group_of = list(range(len(names)))
        self._groups: dict[int, list[int]] = {i: [i] for i in range(len(names))}
        self._merged_ops: dict[tuple[int, ...], Any] = {}
        self._positions: dict[int, tuple[int, int]] = {}  # index → (start, end) emission positions
        #: per graph analysed: (index, is_end) → (emission position, kernels emitted before it)
        self._layouts: dict[tuple, dict[tuple[int, int], tuple[int, int]]] = {}
        self._layouts_full = False
        #: (index, is_end) → the marker whose event it reuses under CUDA graph capture
        self.capture_reuse: dict[tuple[int, int], tuple[int, int]] = {}
        self.graphs_checked = 0
        self._bounds: list[tuple[int, int, Any]] = []
        self._rebuild()
        self._shapes: dict[Any, ShapeGraphs] = {}
        self._timed_calls: dict[Any, int] = {}  # input shape -> its timed calls, up to UNCACHED_TIMED_CALLS
        self._current: ShapeGraphs | None = None
        self._empty_pair: Callable[[Any], float | None] = TorchGraphs().empty_pair_seconds

    # groups ------------------------------------------------------------------------------------

    def add_graph(self, groups: list[list[int]], positions: dict[int, tuple[int, int]] | None = None,
                  layout: dict[tuple[int, int], tuple[int, int]] | None = None) -> None:
        """fusion.py's groups for one graph (indices of this instrumentation), where each region's
        markers were emitted and, per marker (index, is_end), its (emission position, kernels emitted
        before it) in that graph. Merges are sticky: a region merged in any graph of this model stays
        merged in all of them."""
        self.graphs_checked += 1
        self._positions.update(positions or {})
        changed = bool(positions) and any(len(g) > 1 for g in self._groups.values())
        if layout:
            key = tuple(sorted(layout.items()))
            if key not in self._layouts and len(self._layouts) < MAX_LAYOUTS:
                self._layouts[key] = layout
                changed = True
            elif key not in self._layouts:  # too many graphs to follow: no marker shares any more
                self._layouts_full = True
                changed = True
        for group in groups:
            roots = {self._find(i) for i in group}
            if len(roots) > 1:
                keep = min(roots)
                for root in roots - {keep}:
                    for i in self._groups.pop(root):
                        self._group_of[i] = keep
                        self._groups[keep].append(i)
                self._groups[keep].sort()
                changed = True
        if changed:
            self._rebuild()

    def _find(self, index: int) -> int:
        return self._group_of[index]

    def merged(self) -> list[list[str]]:
        """The merged groups, by op name (regions on their own are left out)."""
        return [[self.names[i] for i in g] for g in self._groups.values() if len(g) > 1]

    def _rebuild(self) -> None:
        """Marker actions: the group's first member starts it, its last member ends it."""
        actions: list[tuple[int, Any] | None] = [None] * (2 * len(self.names))
        bounds = []
        for root, members in sorted(self._groups.items()):
            op = self.ops[members[0]] if len(members) == 1 else self._merged_op(members)
            # the group runs from the member whose start is emitted first to the member whose end is
            # emitted last (nested regions: not the last by index); by index where not analysed
            first, last = members[0], members[-1]
            where = self._positions
            if all(m in where for m in members):
                first = min(members, key=lambda m: where[m][0])
                last = max(members, key=lambda m: where[m][1])
            actions[2 * first] = (root, op)
            actions[2 * last + 1] = (root, op)
            bounds.append((first, last, op))
        self._bounds = bounds
        # markers that touch share one event: on the eager path a marker reuses the event of the
        # end just before it (an end's event can be kept for the next pair, as a sequence's
        # boundary is); under capture any marker reuses its neighbour's node
        eager = self._touching([slot for slot, action in enumerate(actions) if action is not None], True)
        if eager:
            kept = set(eager.values())
            actions = [None if action is None else (*action, eager.get(slot, -1), slot in kept)
                       for slot, action in enumerate(actions)]
        captured = self._touching(list(range(2 * len(self.names))), False)
        self.capture_reuse = {(slot >> 1, slot & 1): (previous >> 1, previous & 1)
                              for slot, previous in captured.items()}
        self.marks.actions = actions

    def _touching(self, slots: list[int], after_end_only: bool) -> dict[int, int]:
        """slot → the slot just before it (of ``slots``, in emission order) with no kernel emitted
        between them, where that holds in every analysed graph holding the slot (a slot that has no
        such neighbour in one graph shares in none). ``after_end_only``: the earlier one must be an
        end."""
        if self._layouts_full:
            return {}
        wanted = set(slots)
        found: dict[int, int | None] = {}
        for layout in self._layouts.values():
            here = sorted(((position, seg, 2 * index + is_end) for (index, is_end), (position, seg)
                           in layout.items() if 2 * index + is_end in wanted))
            previous = None
            for position, seg, slot in here:
                candidate = None
                if previous is not None and previous[1] == seg and (not after_end_only or previous[2] & 1):
                    candidate = previous[2]
                if found.get(slot, candidate) != candidate:
                    candidate = None
                found[slot] = candidate
                previous = (position, seg, slot)
        shared = {slot: previous for slot, previous in found.items() if previous is not None}
        # an event serves at most two markers in a row on the eager path: a reused end may be kept
        # again for the next marker (a chain of ends, then a start), never two reusers of one event
        users: dict[int, int] = {}
        for slot, previous in sorted(shared.items()):
            if previous in users:
                del shared[slot]
            else:
                users[previous] = slot
        return shared

    def _merged_op(self, members: list[int]) -> Any:
        key = tuple(members)
        op = self._merged_ops.get(key)
        if op is None:
            names = [self.names[i] for i in members]
            label = "+".join(names) if len(names) <= 4 else f"{names[0]}+...+{names[-1]}"
            op = self._merged_ops[key] = self.core.op_state(label)
            op.owner = self.inst
            self.inst.ops.append(op.name)
            self.inst.op_states.append(op)
        return op

    def group_bounds(self) -> list[tuple[int, int, Any]]:
        """(first index, last index, op) of every group."""
        return self._bounds

    # markers -------------------------------------------------------------------------------------

    @property
    def stray_marks(self) -> int:
        """Markers reached from a thread whose pass was not timed (ignored)."""
        return self.marks.stray_marks

    def mark(self, index: int, is_end: int) -> None:
        """A marker ran: on the thread of the timed pass, it records the region's start or end event
        (``self.marks``: C or Python), or, while its CUDA graph is captured, ``mark_captured``."""
        self.marks.mark(index, is_end)

    def mark_captured(self, index: int, is_end: int) -> None:
        """A marker met (on the timed pass's thread) while its CUDA graph is captured: the kernel
        nodes captured from here on belong to the regions it leaves open (graph_kernels.py)."""
        core = self.core
        labels = core.busy.labels if core.busy is not None else None
        if labels is not None:
            labels.mark(self.slots[index][0] >> 1, is_end)
        shapes = self._current
        if shapes is None:
            core.note_capture()
            return
        shapes.take(index, is_end, core.current_stream(core.current_device()))

    # a timed pass ------------------------------------------------------------------------------

    def timed_call(self, compiled: Callable, args: tuple, kwargs: dict, callback: Any = None) -> Any:
        """Run the timed graph for this pass (or the untimed one when this shape's timed graph has
        not been read since its last replay). ``callback``: dynamo's frame callback to run the
        compiled call under (the caller turned it off for everything else)."""
        key = _shape_key(args, kwargs)
        shapes = self._shapes.get(key)
        if shapes is None and len(self._shapes) < MAX_GRAPH_SHAPES and not self.core.is_host:
            shapes = self._shapes[key] = ShapeGraphs(self, self.core.current_device())
        # entered counts are kept on sampled passes and scaled by passes / sampled passes, so a
        # sampled pass counts whether or not it could be timed
        for op in self.ops:
            op.entered += 1
        for op in self._merged_ops.values():
            op.entered += 1
        if shapes is not None and shapes.replay.busy:
            self.core.dropped["graph_busy"] += 1
            return _run_with(callback, compiled, args, kwargs)
        marks = self.marks
        busy = self.core.busy
        window, traced_cpu_s = None, 0.0
        if busy is not None and busy.labels is not None and shapes is not None and shapes.replayed \
                and busy.due():
            t0 = time.thread_time()
            window = busy.open_graph(self.ops_by_region(), shapes.replay)
            traced_cpu_s = time.thread_time() - t0
        self._current = shapes
        marks.arm()
        self.timed = True
        first_calls = self._first_timed_call(key)
        try:
            if first_calls:
                with _uncached():
                    out = _run_with(callback, compiled, args, kwargs)
            else:
                out = _run_with(callback, compiled, args, kwargs)
        finally:
            self.timed = False
            marks.disarm()
            self._current = None
            if busy is not None and busy.labels is not None:
                busy.labels.end_capture()
        if shapes is not None:
            shapes.replayed = not marks.eager_marks and bool(shapes.events)
            if shapes.replayed:
                self._fence(shapes)  # the timed graph was replayed: read its event nodes after it
        if window is not None:
            t0 = time.thread_time()
            busy.close_graph_pass(window, traced_cpu_s + time.thread_time() - t0)
        return out

    def _first_timed_call(self, key: Any) -> bool:
        """Whether this timed call of input shape ``key`` is one of its first ``UNCACHED_TIMED_CALLS``
        (those that may compile its timed graph, with Inductor's caches off)."""
        calls = self._timed_calls.get(key)
        if calls is None:
            if len(self._timed_calls) >= MAX_COUNTED_SHAPES:
                return False
            calls = 0
        if calls >= UNCACHED_TIMED_CALLS:
            return False
        self._timed_calls[key] = calls + 1
        return True

    def ops_by_region(self) -> dict[int, Any]:
        """Global region id → the op its kernels are reported as (its merged group's, if merged)."""
        ops = {}
        for members in self._groups.values():
            op = self.ops[members[0]] if len(members) == 1 else self._merged_op(members)
            for index in members:
                ops[self.slots[index][0] >> 1] = op
        return ops

    def _fence(self, shapes: ShapeGraphs) -> None:
        core = self.core
        if shapes.baseline_s is None:
            try:
                shapes.baseline_s = self._empty_pair(core)
            except Exception:
                shapes.baseline_s = None
        device = shapes.recorder.device
        free = core.fence_events(device)
        if free is None:
            return
        pairs = shapes.pairs()
        if not pairs:
            return
        shapes.recorder.pairs = pairs
        fence = free.pop()
        stream = core.current_stream(device)
        if core.record_event(fence, stream):
            free.append(fence)
            core.record_failed()
            return
        shapes.replay.busy = True
        core.ring.append(Pending(shapes.replay, device, stream, None, fence, core.active_trace_id(),
                                 None, False))

    def remove(self) -> None:
        with _lock:
            for start, _ in self.slots:
                _regions[start // 2] = None
        for shapes in self._shapes.values():
            if not shapes.replay.busy:
                shapes.destroy()
        self._shapes = {}


def _shape_key(args: tuple, kwargs: dict) -> tuple:
    import torch

    key: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), value.dtype, value.device))
    return tuple(key)


class _uncached:
    """Inductor's and AOT autograd's caches off for a call that may compile the timed graph."""

    def __enter__(self) -> None:
        try:
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config

            self._patches = [inductor_config.patch(fx_graph_cache=False),
                             functorch_config.patch(enable_autograd_cache=False)]
        except Exception:
            self._patches = []
        for patch in self._patches:
            patch.__enter__()

    def __exit__(self, *exc: object) -> None:
        for patch in reversed(self._patches):
            patch.__exit__(None, None, None)


def pass_call(inst: Instrumentation, regions: CompiledRegions, compiled: Callable,
              measure_every: int) -> Callable:
    """The per-pass sampler around the compiled callable. Its frame is skipped by dynamo and the
    frames it calls run with dynamo's callback off, except the compiled call itself: none of the
    timer's Python is ever traced, so none of it can break a graph."""
    state, cost, wall_cost, step_cost = inst.pass_state, inst.cost, inst.wall_cost, inst.step_cost
    clock, wall = time.thread_time_ns, time.perf_counter_ns
    timed_call = regions.timed_call
    setter = _set_eval_frame
    marks = regions.marks
    run_left = run_length = 0  # timed passes left in this run, and the run's length
    # A run of sampled passes is measured (each pass of it, so that the switch into the run and its
    # own passes average out) when ``measure_every`` passes have gone by since the last one measured:
    # every run at the budget's periods (8 and longer), every 8th pass when every pass is sampled,
    # where the two thread-clock reads (system calls, ~0.4 µs each) and the running mean's update
    # were a share of what the timed pass costs and a mean over 1 in 8 is as good.
    # The untimed passes right after a measured run (as many as the run had) are measured too, and
    # what they take over an untimed pass is charged to the run: switching back to the untimed graph
    # is paid there, not in the run (ResNet-50 on an H100: about 350 µs a timed pass at a period of
    # 9, against 84 and 118 µs a pass in two runs with every pass timed, where no switch happens).
    # Each measured pass is read on the wall clock too (``inst.wall_cost``, a vDSO read): the thread's
    # CPU misses its waits off the CPU, and in short blocks on an H100 the timed passes cost about
    # twice what it shows (docs/design.md); the benchmarks compare the clocks, and the budget reads the
    # CPU, scaled where it was measured to miss (``Instrumentation.sampled_pass_cost_s``).
    # And each measured pass's step, from its start to the next pass's (``inst.step_cost``): a step is
    # closed by the next call, whatever it is; one longer than STEP_GAP_FACTOR untimed steps is the
    # program's idle time between requests, not the pass's cost, and is dropped.
    next_measured = 0
    measure_run = False
    after_left = 0  # untimed passes still to measure after the last measured run
    step_start = step_kind = step_closes = 0  # the measured step under way (kind 0: none)

    def close_step(now: int) -> None:
        nonlocal step_kind
        kind, step_kind, step_ns = step_kind, 0, now - step_start
        if step_cost.n_unsampled >= MIN_STEPS_FOR_GAPS and step_ns > STEP_GAP_FACTOR * step_cost.unsampled_ns:
            step_cost.gaps += 1
        elif kind == STEP_AFTER:
            step_cost.add_after(step_ns, step_closes)
        else:
            step_cost.add(kind == STEP_SAMPLED, step_ns)

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal next_measured, run_left, run_length, measure_run, after_left
        nonlocal step_start, step_kind, step_closes
        inst.passes += 1
        if step_kind:
            close_step(wall())
        countdown = state.countdown
        if countdown:
            state.countdown = countdown - 1
            if after_left:
                after_left -= 1
                t0, w0 = clock(), wall()
                out = compiled(*args, **kwargs)
                w1, t1 = wall(), clock()
                closes = 0 if after_left else run_length
                cost.add_after(t1 - t0, closes)
                wall_cost.add_after(w1 - w0, closes)
                step_start, step_kind, step_closes = w0, STEP_AFTER, closes
                return out
            if inst.passes % measure_every:
                return compiled(*args, **kwargs)
            t0, w0 = clock(), wall()
            out = compiled(*args, **kwargs)
            w1, t1 = wall(), clock()
            cost.add(False, t1 - t0)
            wall_cost.add(False, w1 - w0)
            step_start, step_kind = w0, STEP_UNSAMPLED
            return out
        inst.sampled_passes += 1
        if run_left <= 0:  # a run starts: as long as the period allows, if the last timed pass ran eagerly
            regions.ran_eagerly = bool(marks.eager_marks)
            run_length = run_left = min(TIMED_RUN, state.period) if regions.ran_eagerly else 1
            # (not the first ones, which compile and capture)
            measure_run = inst.sampled_passes > UNCACHED_TIMED_CALLS and inst.passes >= next_measured
        run_left -= 1
        # within a run the next pass is timed too; after it, the rest of run_length periods untimed
        state.countdown = 0 if run_left else state.period * run_length - run_length
        measure = measure_run
        callback = setter(None) if setter is not None else None
        try:
            if not measure:
                return timed_call(compiled, args, kwargs, callback)
            t0, w0 = clock(), wall()
            out = timed_call(compiled, args, kwargs, callback)
            w1, t1 = wall(), clock()
            cost.add(True, t1 - t0)
            wall_cost.add(True, w1 - w0)
            step_start, step_kind = w0, STEP_SAMPLED
            next_measured = inst.passes + measure_every
            if not run_left:  # the run is over: measure the untimed passes that follow it
                after_left = run_length
                cost.begin_after()
                wall_cost.begin_after()
                step_cost.begin_after()
        finally:
            if setter is not None:
                setter(callback)
        return out

    return skip_frame(call)
