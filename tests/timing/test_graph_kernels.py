"""Kernel time per module in a compiled model's CUDA graphs: node labels made at capture, carried to
the instantiated graph's clones, and summed from a traced replay's kernel records.

CUPTI cannot run without a GPU: the labels are fed the callbacks CUPTI would make (node ids, kinds,
clones) and the window a fake tracer's kernel records; the real callbacks and records are checked
on a GPU (tests/timing/test_compiled_gpu.py, benchmarks/cupti_graph_probe.py).
"""

from __future__ import annotations

import threading

import pytest
import torch

from gpuscope.timing.graph_kernels import GraphNodeLabels
from tests.timing.conftest import prepared
from tests.timing.test_busy import Clock, FakeClockRoute


def captured_layers() -> GraphNodeLabels:
    """Region 1 holds node 10, region 2 (nested in 1) node 11 and a memset node 12; node 13 comes
    after 2 closed (in 1 only), node 14 after both closed. The graph is instantiated: clones 110-114."""
    labels = GraphNodeLabels()
    labels.mark(1, 0)
    labels.created(10, True)
    labels.mark(2, 0)
    labels.created(11, True)
    labels.created(12, False)
    labels.mark(2, 1)
    labels.created(13, True)
    labels.mark(1, 1)
    labels.created(14, True)
    labels.end_capture()
    for node in range(10, 15):
        labels.cloned(100 + node, node)
    return labels


def test_kernel_nodes_are_labelled_with_every_region_open_at_their_capture():
    labels = captured_layers()
    assert labels.labels == {10: (1,), 11: (1, 2), 13: (1,), 110: (1,), 111: (1, 2), 113: (1,)}


def test_a_replay_s_kernels_are_summed_per_region_per_replay():
    labels = captured_layers()
    one_replay = [(110, 100), (111, 50), (113, 30)]
    unlabelled = [(114, 7), (999, 1000)]  # outside every region; another graph's node
    ns, replays = labels.kernel_ns(one_replay * 2 + unlabelled, {1: "a", 2: "b"}.get)
    assert replays == 2
    assert ns == {"a": 180, "b": 50}  # a nested region's kernels count for its parent too


def test_a_merged_group_counts_each_kernel_once():
    labels = captured_layers()
    ns, replays = labels.kernel_ns([(110, 100), (111, 50), (113, 30)], {1: "a+b", 2: "a+b"}.get)
    assert (ns, replays) == ({"a+b": 180}, 1)


def test_another_model_s_kernels_neither_count_nor_change_the_replay_count():
    labels = captured_layers()
    labels.mark(7, 0)
    labels.created(70, True)
    labels.mark(7, 1)
    mine = [(110, 100), (111, 50), (113, 30)]
    ns, replays = labels.kernel_ns(mine + [(70, 5)] * 3, {1: "a", 2: "b"}.get)
    assert (ns, replays) == ({"a": 180, "b": 50}, 1)
    assert labels.kernel_ns([(70, 5)], {1: "a"}.get) == ({}, 0)


def test_only_the_capturing_thread_s_nodes_are_labelled():
    labels = GraphNodeLabels()
    labels.mark(1, 0)
    other = threading.Thread(target=labels.created, args=(20, True))
    other.start()
    other.join()
    labels.created(21, True)
    assert labels.labels == {21: (1,)}


def test_a_full_table_labels_nothing_more_and_counts_it():
    labels = GraphNodeLabels(max_nodes=2)
    labels.mark(1, 0)
    for node in (1, 2, 3):
        labels.created(node, True)
    labels.cloned(11, 1)
    assert len(labels.labels) == 2 and labels.unlabelled_full == 2


def test_a_pass_that_raised_half_way_leaves_nothing_open():
    labels = GraphNodeLabels()
    labels.mark(1, 0)
    labels.end_capture()
    labels.created(5, True)
    assert labels.labels == {}


# --- the graph window (busy.py) -------------------------------------------------------------------


class FakeGraphTrace:
    """A tracer that sees graph nodes: hands the labels to the test, returns chosen kernel records."""

    def __init__(self, kernels: list[tuple[int, int]]) -> None:
        self.kernels = kernels
        self.labels: GraphNodeLabels | None = None
        self.calls: list[str] = []

    def watch_graph_nodes(self, labels: GraphNodeLabels) -> None:
        self.labels = labels
        self.calls.append("watch")

    def unwatch_graph_nodes(self) -> None:
        self.labels = None
        self.calls.append("unwatch")

    def start(self) -> None:  # the eager window's: not used here
        self.calls.append("start")

    def push(self, external_id: int) -> None: ...

    def pop(self) -> None: ...

    def stop_launches(self) -> None: ...

    def stop(self) -> dict[int, int]:
        self.calls.append("stop")
        return {}

    def start_kernels(self) -> None:
        self.calls.append("start_kernels")

    def stop_graph(self) -> list[tuple[int, int]]:
        self.calls.append("stop_graph")
        return list(self.kernels)


class Replay:
    """What the window watches of a timed graph's replay: busy until the resolver read its events."""

    busy = True


def window_timer(make_timer, kernels):
    route = FakeClockRoute()
    timer = prepared(make_timer(route=route, sample_rate=1.0))
    trace = FakeGraphTrace(kernels)
    busy = timer.enable_kernel_busy(trace, clock=Clock(), min_interval_s=0.0)
    # the op's region time: 4 ms, as event pairs around the graph's kernels would read it
    with timer.region("layer"):
        route.now += 4e-3
    assert timer.flush(5)
    return timer, trace, busy


def test_a_traced_replay_gives_each_op_its_kernel_time_and_busy_ratio(make_timer, registry):
    timer, trace, busy = window_timer(make_timer, [(110, 1_000_000), (111, 2_000_000), (555, 9)])
    labels = trace.labels
    assert labels is busy.labels
    labels.mark(1, 0)
    labels.created(10, True)
    labels.created(11, True)
    labels.mark(1, 1)
    labels.cloned(110, 10)
    labels.cloned(111, 11)
    op = timer.core.op_state("layer")
    replay = Replay()
    window = busy.open_graph({1: op}, replay)
    assert window is not None and not busy.due()
    busy.close_graph_pass(window, 0.0)
    busy.expire()
    assert busy.windows["ok"] == 0, "the replay has not been read yet"
    replay.busy = False
    busy.expire()
    assert busy.windows["ok"] == 1
    assert trace.calls == ["watch", "start_kernels", "stop_graph"]
    assert busy.kernel_seconds[("layer", "cpu")] == pytest.approx(3e-3)
    assert busy.ratios[("layer", "cpu")] == pytest.approx(0.75)
    labels_ = {"op": "layer", "device": "cpu"}
    assert registry.get_sample_value("gpuscope_region_kernel_seconds", labels_) == pytest.approx(3e-3)
    assert registry.get_sample_value("gpuscope_region_gpu_busy_ratio", labels_) == pytest.approx(0.75)


def test_a_replay_with_no_labelled_kernel_is_a_failed_window(make_timer):
    timer, _trace, busy = window_timer(make_timer, [(555, 9)])
    replay = Replay()
    window = busy.open_graph({1: timer.core.op_state("layer")}, replay)
    busy.close_graph_pass(window, 0.0)
    replay.busy = False
    busy.expire()
    assert busy.windows == {"ok": 0, "timeout": 0, "failed": 1}
    assert busy.kernel_seconds == {}


def test_a_replay_with_nothing_queued_to_read_gives_the_window_up(make_timer):
    timer, trace, busy = window_timer(make_timer, [])
    replay = Replay()
    replay.busy = False  # its fence could not be recorded: nothing will say when it completed
    window = busy.open_graph({1: timer.core.op_state("layer")}, replay)
    busy.close_graph_pass(window, 0.0)
    assert busy.windows["failed"] == 1 and not busy.tracing
    assert trace.calls == ["watch", "start_kernels", "stop"]


def test_markers_met_during_capture_label_the_compiled_model_s_nodes(make_timer):
    """CompiledRegions tells the labels which regions its capture has open, and maps region ids to
    the ops (a merged group's op for its members)."""
    timer = prepared(make_timer(sample_rate=1.0))
    busy = timer.enable_kernel_busy(FakeGraphTrace([]), clock=Clock())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    inst = timer.instrument(model, include=("0", "2"))
    inst.run_compiled(model, None, model)
    regions = inst.compiled
    first, second = (start >> 1 for start, _ in regions.slots)
    regions.mark_captured(0, 0)
    busy.labels.created(1, True)
    regions.mark_captured(0, 1)
    regions.mark_captured(1, 0)
    busy.labels.created(2, True)
    regions.mark_captured(1, 1)
    assert busy.labels.labels == {1: (first,), 2: (second,)}
    ops = regions.ops_by_region()
    assert [ops[first].name, ops[second].name] == ["0", "2"]
    regions.add_graph([[0, 1]])  # Inductor fused across the boundary
    ops = regions.ops_by_region()
    assert ops[first] is ops[second] and ops[first].name == "0+2"
    inst.remove()


def test_closing_the_timer_gives_the_graph_node_callbacks_back(make_timer):
    # CUPTI admits one callback subscriber per process: a second timer (the next model a process
    # serves, a benchmark's next workload) could not watch graph nodes while the first held it
    timer, trace, busy = window_timer(make_timer, [])
    assert trace.calls == ["watch"] and busy.labels is not None
    timer.close()
    assert trace.calls == ["watch", "unwatch"] and busy.labels is None and not busy.due()
    again = FakeGraphTrace([])
    second = prepared(make_timer(route=FakeClockRoute(), sample_rate=1.0))
    assert second.enable_kernel_busy(again, clock=Clock()).labels is not None
    second.close()
    assert again.calls == ["watch", "unwatch"]
