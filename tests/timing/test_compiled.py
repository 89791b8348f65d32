"""instrument() on torch.compile'd models, on CPU (Inductor's C++ backend), and the merge rules.

Compiling is slow on CI's two cores, so the compile tests are few and their models tiny.
"""

from __future__ import annotations

import shutil
import threading
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from gpuscope.timing import capture, fusion, hot
from gpuscope.timing import compiled as compiled_mod
from gpuscope.timing.fusion import Kernel, merge_groups
from gpuscope.timing.routes import HostRoute
from tests.timing.conftest import prepared, require_native

# --- merge rules (positions chosen by hand) ----------------------------------------------------


def test_regions_whose_kernels_stay_inside_are_kept_apart():
    # a: start 0, kernel 1, end 2; glue kernel 3; b: start 4, kernel 5, end 6
    kernels = [Kernel(1, frozenset({0})), Kernel(3, frozenset()), Kernel(5, frozenset({1}))]
    assert merge_groups({0: 0, 1: 4}, {0: 2, 1: 6}, kernels) == [[0], [1]]


def test_a_kernel_fused_across_a_boundary_merges_both_regions():
    # a's last op and b's first op in one kernel, emitted before a's end marker
    kernels = [Kernel(1, frozenset({0})), Kernel(2, frozenset({0, 1})), Kernel(6, frozenset({1}))]
    assert merge_groups({0: 0, 1: 4}, {0: 3, 1: 7}, kernels) == [[0, 1]]


def test_a_kernel_moved_out_of_its_region_merges_every_region_it_crossed():
    # c's kernel emitted before b's start: b's span would miss it, a's would not hold it alone
    kernels = [Kernel(1, frozenset({0})), Kernel(3, frozenset({2})), Kernel(5, frozenset({1})),
               Kernel(9, frozenset({2}))]
    starts, ends = {0: 0, 1: 4, 2: 8}, {0: 2, 1: 6, 2: 10}
    assert merge_groups(starts, ends, kernels) == [[0], [1, 2]]


def test_glue_inside_a_span_is_charged_to_it_and_nested_regions_stay_apart():
    # layer (0) holds attn (1); a glue kernel inside the layer is the layer's
    kernels = [Kernel(2, frozenset({0, 1})), Kernel(4, frozenset()), Kernel(5, frozenset({0}))]
    assert merge_groups({0: 0, 1: 1}, {0: 6, 1: 3}, kernels) == [[0], [1]]


def test_a_region_missing_a_marker_merges_the_whole_graph():
    assert merge_groups({0: 0}, {0: 2, 1: 5}, [Kernel(1, frozenset({0}))]) == [[0, 1]]


# --- the markers (C and Python), without a compiled model ---------------------------------------


def counts(timer) -> dict[str, int]:
    assert timer.flush(5)
    return {op.name: sum(h.count for h in op.hists.values()) for op in timer.core.ops()}


def test_markers_time_their_regions_on_the_timed_pass_s_thread_only(make_timer):
    timer = prepared(make_timer(sample_rate=1.0))
    core = timer.core
    pool = core.pools[core.current_device()]
    size = len(pool)
    a, b = core.op_state("a"), core.op_state("b")
    marks = hot.region_marks(core, 2, lambda index, is_end: pytest.fail("no capture here"))
    marks.actions = [(0, a), (0, a), (1, b), (1, b)]
    marks.mark(0, 0)  # no timed pass: ignored
    marks.mark(0, 1)
    marks.arm()
    assert marks.armed
    for index, is_end in ((0, 0), (1, 0), (1, 1), (0, 1)):  # b nested in a
        marks.mark(index, is_end)
    other = threading.Thread(target=marks.mark, args=(0, 0))
    other.start()
    other.join()
    marks.disarm()
    marks.mark(1, 0)
    assert not marks.armed
    assert marks.stray_marks == 4 and marks.eager_marks == 4
    assert counts(timer) == {"a": 1, "b": 1}
    assert len(pool) == size and len({id(event) for event in pool}) == size  # each event back once


def test_a_merged_group_runs_from_its_first_start_to_its_last_end(make_timer):
    timer = prepared(make_timer(sample_rate=1.0))
    ab = timer.core.op_state("a+b")
    marks = hot.region_marks(timer.core, 2, None)
    marks.actions = [(0, ab), None, None, (0, ab)]  # what CompiledRegions sets for a merged a, b
    marks.arm()
    for index, is_end in ((0, 0), (0, 1), (1, 0), (1, 1)):
        marks.mark(index, is_end)
    marks.disarm()
    assert counts(timer) == {"a+b": 1}


def test_a_start_that_never_ends_gives_its_event_back(make_timer):
    timer = prepared(make_timer(sample_rate=1.0))
    core = timer.core
    pool = core.pools[core.current_device()]
    size = len(pool)
    marks = hot.region_marks(core, 1, None)
    marks.actions = [(0, core.op_state("a")), (0, core.op_state("a"))]
    marks.arm()
    marks.mark(0, 0)
    marks.mark(0, 0)  # started again (the first start's event comes back)
    assert len(pool) == size - 1
    marks.disarm()  # the pass ended half-way: its open start comes back
    assert len(pool) == size
    marks.arm()
    marks.mark(0, 0)
    marks.arm()  # a new pass: the same
    assert len(pool) == size
    marks.disarm()
    assert counts(timer) == {"a": 0}


class CapturingRoute(HostRoute):
    def is_capturing(self) -> bool:
        return True


def test_a_marker_met_during_a_graph_capture_goes_to_the_capture_handler(make_timer):
    timer = make_timer(sample_rate=1.0, route=CapturingRoute())
    met: list[tuple[int, int]] = []
    marks = hot.region_marks(timer.core, 1, lambda index, is_end: met.append((index, is_end)))
    marks.actions = [(0, timer.core.op_state("a")), (0, timer.core.op_state("a"))]
    marks.arm()
    capture.in_progress[0] += 1
    try:
        marks.mark(0, 0)
        marks.mark(0, 1)
    finally:
        capture.in_progress[0] -= 1
    marks.disarm()
    assert met == [(0, 0), (0, 1)] and marks.eager_marks == 0
    assert counts(timer) == {"a": 0}


def test_the_mark_table_runs_a_slot_s_markers_in_c_and_never_raises(make_timer):
    require_native()
    timer = prepared(make_timer(sample_rate=1.0, native=True))
    core = timer.core
    marks = hot.region_marks(core, 2, None)
    marks.actions = [(0, core.op_state("a")), (0, core.op_state("a")), (1, "not an op"), (1, "not an op")]
    fallback_calls: list[int] = []
    entries = [None, ("regions", 0, marks), ("regions", 1, marks), ("regions", 0, object())]
    table = hot.mark_table(entries, lambda x, slot: fallback_calls.append(slot))
    x = torch.zeros(1)
    marks.arm()
    for slot in (0, 1, 2, 3, 99, 6, 7):  # region 0: no entry; region 1: a; region 3: not C markers
        assert table(x, slot) is None
    table(x, 4)
    table(x, 5)  # "not an op": end() raises TypeError, counted as an error, never raised here
    marks.disarm()
    assert fallback_calls == [6, 7]
    assert core.dropped["error"] == 1
    assert counts(timer)["a"] == 1


# --- compiled models on CPU --------------------------------------------------------------------

needs_compiler = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                    reason="Inductor's CPU backend needs a C++ compiler")


class Block(torch.nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


OPS = ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]


def compiled_and_instrumented(order: str, timer):
    torch.manual_seed(0)
    model = Model().eval()
    if order == "compile, then instrument":
        compiled = torch.compile(model)
        inst = timer.instrument(compiled, include=("attn", "mlp"))
    elif order == "instrument, then compile":
        inst = timer.instrument(model, include=("attn", "mlp"))
        compiled = torch.compile(model)
    else:  # in place
        inst = timer.instrument(model, include=("attn", "mlp"))
        model.compile()
        compiled = model
    return model, compiled, inst


@needs_compiler
@pytest.mark.parametrize("order", ["compile, then instrument", "instrument, then compile", "in place"])
def test_a_compiled_model_is_timed_with_no_graph_break(make_timer, order):
    timer = make_timer(sample_rate=0.5)  # every other pass timed: both graphs run
    torch._dynamo.reset()
    counters.clear()
    model, compiled, inst = compiled_and_instrumented(order, timer)
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = Model.forward(model, x) if order != "in place" else None
        outputs = [compiled(x) for _ in range(6)]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2  # the untimed graph and its timed twin
    if expected is not None:
        for out in outputs:  # timed and untimed passes return the same values
            torch.testing.assert_close(out, expected)
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    assert inst.passes == 6 and inst.sampled_passes == 3
    assert inst.compiled.graphs_checked >= 1  # the timed graph's regions were checked for merges
    assert timer.flush(5)
    timed = {op.name: op.hists for op in timer.core.ops()}
    groups = inst.compiled.merged()
    for name in OPS:
        if any(name in group for group in groups):
            continue
        assert sum(h.count for h in timed[name].values()) == 3, name
    assert inst.compiled.stray_marks == 0
    pool = timer.core.pools[timer.core.current_device()]
    assert len({id(event) for event in pool}) == len(pool) == timer.core.pool_size  # every event back, once
    inst.remove()
    assert "forward" not in model.blocks[0].attn.__dict__


class Fusing(torch.nn.Module):
    """a's output feeds b's elementwise ops: Inductor may fuse them into a's last kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Sigmoid(), torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@needs_compiler
def test_regions_fused_by_inductor_are_reported_merged_and_never_apart(make_timer):
    timer = make_timer(sample_rate=1.0)
    torch._dynamo.reset()
    counters.clear()
    graphs: list[tuple] = []

    def listen(*found) -> None:
        graphs.append(found)

    fusion.add_listener(listen)
    codes: list[str] = []
    from torch._inductor.graph import GraphLowering

    try:
        model = Fusing().eval()
        compiled = torch.compile(model)
        inst = timer.instrument(compiled, include=("a", "b"))
        with torch.no_grad(), mock.patch.object(GraphLowering, "save_output_code", codes.append):
            for _ in range(3):
                compiled(torch.randn(4, 16))
    finally:
        fusion.remove_listener(listen)
    assert not counters["graph_break"]
    # the markers call the timer's callable directly: no op dispatch from the emitted code
    code = "\n".join(codes)
    assert f"torch.ops.gpuscope.{fusion.DIRECT_ATTR}(" in code
    assert "torch.ops.gpuscope.region_mark.default(" not in code
    assert graphs, "the timed graph was not analysed"
    starts, ends, kernels = graphs[-1]
    groups = merge_groups(starts, ends, kernels)
    merged = inst.compiled.merged()
    assert timer.flush(5)
    names = {op.name: sum(h.count for h in op.hists.values()) for op in timer.core.ops()}
    if any(len(g) > 1 for g in groups):
        assert merged == [["a", "b"]]
        assert names["a+b"] == 3 and names["a"] == 0 and names["b"] == 0
    else:  # kept apart: every kernel of each region lies between its own markers
        assert merged == []
        assert names["a"] == 3 and names["b"] == 3


@needs_compiler
def test_every_pass_sampled_times_every_pass_and_measures_its_cost_one_in_eight(make_timer):
    # The pass wrapper reads the thread clock around a sampled pass only every 8th pass when every
    # pass is sampled; the regions are timed on every one of them all the same.
    timer = make_timer(sample_rate=1.0)
    torch._dynamo.reset()
    _, compiled, inst = compiled_and_instrumented("compile, then instrument", timer)
    x = torch.randn(4, 32)
    passes = 3 + 40  # the first three compile, with their caches off, and are never measured
    with torch.no_grad():
        for _ in range(passes):
            compiled(x)
    assert inst.sampled_passes == passes
    assert inst.cost.n_sampled == 40 // 8
    timed = counts(timer)
    groups = inst.compiled.merged()
    for name in OPS:
        if not any(name in group for group in groups):
            assert timed[name] == passes, name
    assert sum(timer.core.dropped.values()) == 0
    pool = timer.core.pools[timer.core.current_device()]
    assert len({id(event) for event in pool}) == len(pool) == timer.core.pool_size  # every event back, once


@needs_compiler
def test_only_a_shape_s_first_timed_calls_turn_inductor_s_caches_off(make_timer, monkeypatch):
    # The first timed calls of an input shape may compile its timed graph, with Inductor's caches off
    # (a graph loaded from a cache skips the code generation where merges are checked); after them,
    # and for shapes past those counted, a timed pass leaves the caches alone: patching them on every
    # timed pass cost about 43 µs on the CPU host.
    entered = []

    class Counting(compiled_mod._uncached):
        def __enter__(self) -> None:
            entered.append(1)
            super().__enter__()

    monkeypatch.setattr(compiled_mod, "_uncached", Counting)
    monkeypatch.setattr(compiled_mod, "MAX_COUNTED_SHAPES", 1)
    timer = make_timer(sample_rate=1.0)
    torch._dynamo.reset()
    _, compiled, inst = compiled_and_instrumented("compile, then instrument", timer)
    with torch.no_grad():
        for rows in (4, 4, 4, 4, 4, 6, 6, 6):
            compiled(torch.randn(rows, 32))
    assert inst.sampled_passes == 8
    assert len(entered) == compiled_mod.UNCACHED_TIMED_CALLS  # the first shape's; the second is past


@needs_compiler
def test_at_the_budget_s_periods_sampled_passes_come_in_runs_and_are_measured(make_timer):
    # under default compile, a sampled pass switches the compiled model to its timed graph and back:
    # runs of TIMED_RUN timed passes in a row switch a TIMED_RUN-th as often, at the same rate
    timer = make_timer(sample_rate=1 / 8)
    torch._dynamo.reset()
    _, compiled, inst = compiled_and_instrumented("compile, then instrument", timer)
    x = torch.randn(4, 32)
    timed = []
    with torch.no_grad():
        for _ in range(8 * 40):
            before = inst.sampled_passes
            compiled(x)
            timed.append(inst.sampled_passes > before)
    assert abs(sum(timed) - 40) <= compiled_mod.TIMED_RUN  # the rate is the period's
    runs = [len(run) for run in "".join("x" if t else "." for t in timed).split(".") if run]
    assert runs[0] == 1 and set(runs[1:]) == {compiled_mod.TIMED_RUN}  # the first, before its marks ran
    # every run is measured once the first ones (which compile, caches off) are over
    assert inst.cost.n_sampled >= sum(timed) - 3 - compiled_mod.TIMED_RUN


def test_under_cuda_graphs_or_every_pass_timed_no_runs_are_made():
    from types import SimpleNamespace

    from gpuscope.timing.instrument import PassCost

    state = SimpleNamespace(countdown=0, period=8)
    inst = SimpleNamespace(passes=0, sampled_passes=0, pass_state=state, cost=PassCost(),
                           wall_cost=PassCost(), step_cost=PassCost())
    # a replayed graph's marks are nodes, not eager records: eager_marks stays 0
    regions = SimpleNamespace(marks=SimpleNamespace(eager_marks=0),
                              timed_call=lambda fn, args, kwargs, callback: fn(*args, **kwargs))
    call = compiled_mod.pass_call(inst, regions, lambda: None, 8)
    timed = []
    for _ in range(64):
        before = inst.sampled_passes
        call()
        timed.append(inst.sampled_passes > before)
    assert timed == [True, *[False] * 7] * 8


def clocked_passes(monkeypatch, untimed_ns, timed_ns: tuple[int, int]):
    """The per-pass sampler at a period of 9 over a fake thread clock and wall clock: an untimed pass
    takes ``untimed_ns(right_after_a_timed_one)`` of both, a timed one ``timed_ns`` (CPU, wall). Returns
    (the per-pass callable, the instrumentation's means, the wall clock, whether the last pass was
    timed), the last two as one-element lists the caller may move."""
    from types import SimpleNamespace

    from gpuscope.timing.instrument import PassCost

    now, wall, last_timed = [0], [0], [False]
    monkeypatch.setattr(compiled_mod.time, "thread_time_ns", lambda: now[0])
    monkeypatch.setattr(compiled_mod.time, "perf_counter_ns", lambda: wall[0])

    def untimed() -> None:
        spent = untimed_ns(last_timed[0])
        now[0] += spent
        wall[0] += spent
        last_timed[0] = False

    def timed(fn, args, kwargs, callback) -> None:
        now[0] += timed_ns[0]
        wall[0] += timed_ns[1]
        last_timed[0] = True

    state = SimpleNamespace(countdown=0, period=9)
    inst = SimpleNamespace(passes=0, sampled_passes=0, pass_state=state, cost=PassCost(),
                           wall_cost=PassCost(), step_cost=PassCost())
    regions = SimpleNamespace(marks=SimpleNamespace(eager_marks=1), timed_call=timed)
    return compiled_mod.pass_call(inst, regions, untimed, 8), inst, wall, last_timed


def test_a_timed_pass_that_costs_the_gpu_shows_in_its_step_not_in_its_call(monkeypatch):
    # A timed pass whose kernels run longer on the GPU (its marks split Inductor's fusions) returns
    # from the call as fast as ever: the program pays when it waits for the GPU after it. Its step,
    # from its start to the next pass's, holds that; idle time between requests is not a pass's cost.
    # An untimed pass is 1,000 ns; a timed one 300 ns more on the CPU, all of it in the call.
    call, inst, wall, last_timed = clocked_passes(monkeypatch, lambda after_timed: 1_000, (1_300, 1_300))
    for i in range(40 * 72):
        call()
        # the program waits for the GPU: 5,000 ns, and 700 more after a timed pass
        wall[0] += 5_000 + (700 if last_timed[0] else 0)
        if i % 97 == 96:
            wall[0] += 10**6  # idle until the next request
    assert inst.cost.per_sampled_pass_s() == pytest.approx(300e-9)  # the call: its CPU
    assert inst.wall_cost.per_sampled_pass_s() == pytest.approx(300e-9)
    assert inst.step_cost.per_sampled_pass_s() == pytest.approx(1_000e-9)  # and its wait: its GPU time
    assert inst.step_cost.gaps >= 3  # idle gaps that closed a measured step, dropped


def test_switching_back_after_a_run_is_charged_to_the_run(monkeypatch):
    # Under default compile the pass after a run of timed ones switches back to the untimed graph,
    # whose code and buffers have gone cold (about 350 µs a timed pass on an H100's ResNet-50 at a
    # period of 9, where every pass timed cost 84-118 µs): the budget's estimate must include it.
    # An untimed pass is 1,000 ns, 2,400 more right after a timed one; a timed pass 300 ns more than
    # untimed, and 800 ns off the CPU.
    call, inst, _, _ = clocked_passes(monkeypatch, lambda after_timed: 1_000 + (2_400 if after_timed else 0),
                                      (1_300, 2_100))
    for _ in range(40 * 72):
        call()
    cost = inst.cost
    assert cost.n_after >= 30  # a window after (nearly) every run
    assert cost.unsampled_ns == pytest.approx(1_000)  # the windows after runs stay out of this mean
    # 300 ns of its own, and a run of 8 shares the 2,400 ns switch back
    assert cost.per_sampled_pass_s() == pytest.approx(600e-9)
    # the wall clock also sees the 800 ns each timed pass waited off the CPU
    assert inst.wall_cost.per_sampled_pass_s() == pytest.approx(1_400e-9)


def test_the_budget_charges_a_default_compiled_pass_on_a_gpu_what_its_cpu_was_measured_to_miss():
    # On an H100 a timed pass under default torch.compile cost 1.5-2.6 times what the launching
    # thread's CPU showed; under graph trees (marks replayed as nodes) and on the host route it did not
    from types import SimpleNamespace

    from gpuscope.timing.instrument import Instrumentation, PassCost

    cost = PassCost()
    for _ in range(10):
        cost.add(True, 3_000)
        cost.add(False, 1_000)

    def charged(ran_eagerly: bool | None, gpu: bool) -> float | None:
        regions = None if ran_eagerly is None else SimpleNamespace(ran_eagerly=ran_eagerly)
        route = SimpleNamespace(gpu_queue=gpu)
        inst = SimpleNamespace(cost=cost, compiled=regions, core=SimpleNamespace(route=route))
        return Instrumentation.sampled_pass_cost_s(inst)

    assert charged(True, True) == pytest.approx(2_000e-9 * compiled_mod.UNSEEN_COST_FACTOR)
    assert charged(False, True) == pytest.approx(2_000e-9)  # CUDA graph trees
    assert charged(True, False) == pytest.approx(2_000e-9)  # the host route: the CPU is the cost
    assert charged(None, True) == pytest.approx(2_000e-9)  # not compiled
    assert Instrumentation.sampled_pass_cost_s(SimpleNamespace(cost=PassCost(), compiled=None)) is None
