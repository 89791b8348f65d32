"""Markers of compiled models that touch share one event: where no kernel is emitted between a
region's end and the next marker, the next one reuses the end's event (default compile: the C or
Python markers; CUDA graph capture: one event node instead of two). Every event still comes back
to its pool exactly once."""

from __future__ import annotations

import itertools
import shutil
import types

import pytest
import torch

from gpuscope.timing import Timer
from gpuscope.timing.compiled import CompiledRegions, ShapeGraphs
from tests.timing.conftest import prepared, require_native
from tests.timing.cuda_shaped import CudaShapedRoute


def regions_for(timer: Timer, names: list[str]) -> CompiledRegions:
    core = timer.core
    inst = types.SimpleNamespace(core=core, ops=list(names), op_states=[])
    return CompiledRegions(inst, list(names), [core.op_state(name) for name in names])


def chain_layout(n: int, kernel_between: set[int] = frozenset()) -> dict:
    """n sibling regions, one kernel each; a glue kernel after region i for i in ``kernel_between``.
    (index, is_end) → (emission position, kernels emitted before it)."""
    layout, position, kernels = {}, 0, 0
    for i in range(n):
        layout[(i, 0)] = (position, kernels)
        position, kernels = position + 2, kernels + 1  # the region's kernel
        layout[(i, 1)] = (position, kernels)
        position += 1
        if i in kernel_between:
            position, kernels = position + 1, kernels + 1
    return layout


def reuse(regions: CompiledRegions) -> dict[int, int]:
    """slot → the slot whose event it reuses (default compile)."""
    return {slot: a[2] for slot, a in enumerate(regions.marks.actions) if a is not None and len(a) == 4
            and a[2] >= 0}


def test_touching_markers_share_and_a_kernel_between_them_keeps_them_apart(make_timer):
    timer = make_timer(sample_rate=1.0)
    regions = regions_for(timer, ["a", "b", "c"])
    try:
        regions.add_graph([[0], [1], [2]], None, chain_layout(3, kernel_between={1}))
        assert reuse(regions) == {2: 1}  # b's start reuses a's end; a kernel sits between b and c
        kept = [slot for slot, a in enumerate(regions.marks.actions) if a is not None and a[3]]
        assert kept == [1]
        assert regions.capture_reuse == {(1, 0): (0, 1)}
        # another graph where a kernel sits between a and b: they never share again
        regions.add_graph([[0], [1], [2]], None, chain_layout(3, kernel_between={0, 1}))
        assert reuse(regions) == {} and regions.capture_reuse == {}
    finally:
        regions.remove()


def test_a_graph_whose_analysis_failed_shares_nothing(make_timer):
    from gpuscope.timing import compiled

    timer = make_timer(sample_rate=1.0)
    regions = regions_for(timer, ["a", "b"])
    try:
        first = regions.slots[0][0] // 2
        # what fusion reports after a failed analysis: every region missing its start, ends at 0
        compiled._on_graph({}, {first: 0, first + 1: 0}, [])
        assert regions.merged() == [["a", "b"]]
        assert reuse(regions) == {} and regions.capture_reuse == {}
    finally:
        regions.remove()


def test_nested_regions_share_an_end_and_under_capture_a_start(make_timer):
    timer = make_timer(sample_rate=1.0)
    regions = regions_for(timer, ["layer", "attn"])
    try:
        # layer start 0, attn start 1, kernel 2, attn end 3, layer end 4
        layout = {(0, 0): (0, 0), (1, 0): (1, 0), (1, 1): (3, 1), (0, 1): (4, 1)}
        regions.add_graph([[0], [1]], None, layout)
        # eager: a start never reuses a start (an event is the end of at most one kept pair)
        assert reuse(regions) == {1: 3}
        assert regions.capture_reuse == {(1, 0): (0, 0), (0, 1): (1, 1)}
    finally:
        regions.remove()


def test_a_merged_group_shares_with_its_neighbour_through_its_outer_markers(make_timer):
    timer = make_timer(sample_rate=1.0)
    regions = regions_for(timer, ["a", "b", "c"])
    try:
        layout = chain_layout(3)
        regions.add_graph([[0, 1], [2]], {0: (0, 2), 1: (3, 5), 2: (6, 8)}, layout)
        actions = regions.marks.actions
        assert actions[1] is None and actions[2] is None  # inside the group a+b
        assert reuse(regions) == {4: 3}  # c's start reuses a+b's end (b's end marker)
    finally:
        regions.remove()


def run_chain(marks, n: int, order=None) -> None:
    marks.arm()
    for index, is_end in order or [(i, e) for i in range(n) for e in (0, 1)]:
        marks.mark(index, is_end)
    marks.disarm()


def pool_back_once(timer: Timer) -> None:
    assert timer.flush(5)
    pool = timer.core.pools[timer.core.current_device()]
    assert len(pool) == timer.core.pool_size and len({id(event) for event in pool}) == len(pool)


def counts(timer: Timer) -> dict[str, int]:
    assert timer.flush(5)
    return {op.name: sum(h.count for h in op.hists.values()) for op in timer.core.ops()}


@pytest.mark.parametrize("n", [1, 2, 6])
def test_a_chain_of_n_sibling_regions_records_n_plus_one_events(make_timer, n):
    timer = prepared(make_timer(sample_rate=1.0))
    names = [f"layer{i}" for i in range(n)]
    regions = regions_for(timer, names)
    try:
        regions.add_graph([[i] for i in range(n)], None, chain_layout(n))
        run_chain(regions.marks, n)
        assert regions.marks.records == n + 1 and regions.marks.eager_marks == 2 * n
        assert counts(timer) == {name: 1 for name in names}
        # apart (a kernel after each region): two records per region, as before
        regions.add_graph([[i] for i in range(n)], None, chain_layout(n, kernel_between=set(range(n))))
        run_chain(regions.marks, n)
        assert regions.marks.records == 2 * n
        assert counts(timer) == {name: 2 for name in names}
        pool_back_once(timer)
    finally:
        regions.remove()


def test_a_shared_region_measures_from_its_neighbour_s_end_to_its_own_end(make_timer):
    """The host route's events are clock reads: a reused start reads the same instant as the end it
    reuses, so b's time is what it would be with its own start recorded there."""
    timer = prepared(make_timer(sample_rate=1.0))
    regions = regions_for(timer, ["a", "b"])
    try:
        regions.add_graph([[0], [1]], None, chain_layout(2))
        run_chain(regions.marks, 2)
        assert regions.marks.records == 3
        assert counts(timer) == {"a": 1, "b": 1}
        pool_back_once(timer)
    finally:
        regions.remove()


@pytest.mark.parametrize("where", ["pass ends", "another marker runs", "start reused, never ended",
                                   "end reused, then the pass ends", "ring full"])
def test_a_kept_event_no_marker_takes_comes_back_once(make_timer, where):
    timer = prepared(make_timer(sample_rate=1.0, **({"ring_size": 1} if where == "ring full" else {})))
    regions = regions_for(timer, ["a", "b", "c"])
    try:
        # a | b then c nested at b's end: a.end → b.start shared, c.end → b.end shared
        layout = {(0, 0): (0, 0), (0, 1): (2, 1), (1, 0): (3, 1), (2, 0): (5, 2), (2, 1): (7, 3),
                  (1, 1): (8, 3)}
        regions.add_graph([[0], [1], [2]], None, layout)
        assert reuse(regions) == {2: 1, 3: 5}
        order = {
            "pass ends": [(0, 0), (0, 1)],
            "another marker runs": [(0, 0), (0, 1), (2, 0), (2, 1), (1, 0), (1, 1)],
            "start reused, never ended": [(0, 0), (0, 1), (1, 0)],
            "end reused, then the pass ends": [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (1, 1)],
            "ring full": [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (1, 1)],
        }[where]
        run_chain(regions.marks, 3, order)
        timed = counts(timer)
        if where == "another marker runs":  # c ran between a's end and b's start: b records its own
            assert regions.marks.records == 6 and timed == {"a": 1, "b": 1, "c": 1}
        elif where == "end reused, then the pass ends":
            assert regions.marks.records == 4 and timed == {"a": 1, "b": 1, "c": 1}
        elif where != "ring full":
            assert timed["a"] == 1 and timed["b"] == 0
        pool_back_once(timer)
    finally:
        regions.remove()


# --- C markers with the recycler (events given back by its thread) ------------------------------


@pytest.mark.parametrize("read", ["unread", "read"])
def test_shared_events_come_back_once_through_the_recycler(read):
    require_native()
    route = CudaShapedRoute()
    timer = prepared(Timer(None, route=route, sample_rate=1.0, native=True, resolve_interval=3600,
                           pool_size=64))
    timer.resolver.baseline_s[0] = 0.0
    assert timer.core.recycling
    regions = regions_for(timer, ["a", "b", "c"])
    try:
        regions.add_graph([[0], [1], [2]], None, chain_layout(3))
        if read == "unread":
            route.gpu_ms = 0.0
        marks = regions.marks
        marks.arm()
        for index, is_end in ((0, 0), (0, 1), (1, 0), (1, 1)):
            marks.mark(index, is_end)
        if read == "read":
            assert timer.core.hot.recycle_pass(5.0)
        marks.disarm()  # c never ran: b's kept end comes back after b's pair is read
        assert marks.records == 3
        for _ in range(3):
            run_chain(marks, 3)
            assert marks.records == 4
        route.gpu_ms = float("inf")
        assert timer.flush(5)
        assert {op: sum(h.count for h in timer.op_state(op).hists.values()) for op in "abc"} == \
            {"a": 4, "b": 4, "c": 3}
        free = timer.core.pools[0]
        assert len(free) == 64 and len(set(free)) == 64
    finally:
        regions.remove()
        timer.close(timeout=1.0)


# --- CUDA graph capture: one event node per boundary ---------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.taken: list[object] = []

    def take(self, stream: int) -> object:
        self.taken.append(object())
        return self.taken[-1]


def captured(regions: CompiledRegions, order) -> ShapeGraphs:
    shapes = ShapeGraphs.__new__(ShapeGraphs)
    shapes.regions, shapes.recorder, shapes.events, shapes.last, shapes.retired = \
        regions, Recorder(), {}, None, []
    for index, is_end in order:
        shapes.take(index, is_end, 7)
    return shapes


@pytest.mark.parametrize("n", [1, 4])
def test_a_captured_chain_of_n_regions_holds_n_plus_one_event_nodes(make_timer, n):
    timer = make_timer(sample_rate=1.0)
    regions = regions_for(timer, [f"layer{i}" for i in range(n)])
    try:
        order = [(i, e) for i in range(n) for e in (0, 1)]
        regions.add_graph([[i] for i in range(n)], None, chain_layout(n))
        shapes = captured(regions, order)
        assert shapes.nodes == len(shapes.recorder.taken) == n + 1
        pairs = shapes.pairs()
        assert len(pairs) == n
        for (_, _, end), (_, start, _) in itertools.pairwise(pairs):
            assert end is start  # layer i's end node is layer i+1's start node
        regions.add_graph([[i] for i in range(n)], None, chain_layout(n, kernel_between=set(range(n))))
        assert captured(regions, order).nodes == 2 * n
    finally:
        regions.remove()


def test_a_captured_marker_shares_only_with_the_marker_met_just_before_it(make_timer):
    timer = make_timer(sample_rate=1.0)
    regions = regions_for(timer, ["a", "b", "c"])
    try:
        regions.add_graph([[0], [1], [2]], None, chain_layout(3))
        shapes = captured(regions, [(0, 0), (0, 1), (2, 0), (1, 0), (1, 1), (2, 1)])
        assert shapes.events[(1, 0)] is not shapes.events[(0, 1)]  # c's start ran between them
        assert shapes.events[(2, 1)] is not shapes.events[(1, 1)]  # not c's neighbour either
        # a marker on another stream never shares a node recorded on the first one
        shapes = captured(regions, [(0, 0), (0, 1)])
        shapes.take(1, 0, 8)
        assert shapes.events[(1, 0)] is not shapes.events[(0, 1)]
    finally:
        regions.remove()


# --- a compiled chain on CPU ---------------------------------------------------------------------

needs_compiler = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                    reason="Inductor's CPU backend needs a C++ compiler")


class Layer(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.lin(x))


@needs_compiler
def test_a_compiled_chain_records_one_event_per_boundary(make_timer):
    n = 3
    timer = make_timer(sample_rate=1.0)
    torch._dynamo.reset()
    model = torch.nn.Sequential(*(Layer() for _ in range(n))).eval()
    compiled = torch.compile(model)
    inst = timer.instrument(compiled, include=tuple(str(i) for i in range(n)))
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
        for _ in range(4):
            torch.testing.assert_close(compiled(x), expected)
            marks = inst.compiled.marks
            assert marks.eager_marks == 2 * n
            if not inst.compiled.merged():
                assert marks.records == n + 1  # each layer's end is the next one's start
    assert timer.flush(5)
    if not inst.compiled.merged():
        assert {op: sum(h.count for h in timer.op_state(op).hists.values()) for op in inst.ops} == \
            {str(i): 4 for i in range(n)}
    pool_back_once(timer)
    inst.remove()

