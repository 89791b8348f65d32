"""Regions inside CUDA graphs (graphs.py), on a fake GPU that replays recorded nodes in order."""

from __future__ import annotations

import pytest

from gpuscope.timing import capture
from gpuscope.timing.graphs import TimedGraph
from tests.timing.conftest import ScriptedRoute


class GraphGpu(ScriptedRoute):
    """A GPU clock that advances by ``work`` and by each record; while capturing, work and
    external records become nodes of the graph, which a replay executes in order."""

    name = "graph-fake"
    on_host = False

    def __init__(self) -> None:
        super().__init__(step=1e-6)
        self.capturing = False
        self.nodes: list[tuple[str, object]] = []

    def is_capturing(self) -> bool:
        return self.capturing

    def work(self, seconds: float) -> None:
        if self.capturing:
            self.nodes.append(("work", seconds))
        else:
            self.clock += seconds

    def record_external(self, event, stream) -> int:
        assert self.capturing, "an external record outside capture"
        self.nodes.append(("event", event))
        return 0


class FakeGraphs:
    """The TimedGraph backend over GraphGpu: a graph is the node list of its capture."""

    def __init__(self, gpu: GraphGpu) -> None:
        self.gpu = gpu
        self.replays: list[int] = []  # which graph each replay ran (index in capture order)
        self.graphs: list[list] = []

    def warm_up(self, step, times: int) -> None:
        for _ in range(times):
            step()

    def capture(self, step):
        gpu = self.gpu
        gpu.capturing, gpu.nodes = True, []
        capture.in_progress[0] += 1
        try:
            output = step()
        finally:
            capture.in_progress[0] -= 1
            gpu.capturing = False
        self.graphs.append(gpu.nodes)
        return len(self.graphs) - 1, output

    def replay(self, graph: int) -> None:
        self.replays.append(graph)
        for kind, value in self.graphs[graph]:
            if kind == "work":
                self.gpu.clock += value
            else:
                self.gpu.clock += self.gpu.step
                value[0] = self.gpu.clock


WORK = {"attn": 10e-6, "mlp": 30e-6}


def make_step(timer, gpu: GraphGpu, mode: str = "regions"):
    def step():
        if mode == "sequence":
            seq = timer.sequence()
            seq.begin(sampled=True)
            for op, seconds in WORK.items():
                seq.split(op)
                gpu.work(seconds)
            seq.end()
        else:
            for op, seconds in WORK.items():
                with timer.region(op):
                    gpu.work(seconds)
        return "output"

    return step


def count(registry, op):
    return registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": "0"})


def mean(registry, op):
    labels = {"op": op, "device": "0"}
    return (registry.get_sample_value("gpuscope_region_gpu_seconds_sum", labels)
            / registry.get_sample_value("gpuscope_region_gpu_seconds_count", labels))


@pytest.mark.parametrize("mode", ["regions", "sequence"])
def test_every_nth_replay_is_timed_from_the_graph_nodes(make_timer, registry, mode):
    gpu = GraphGpu()
    timer = make_timer(route=gpu, sample_rate=1.0, calibrate_every=0)
    graphs = FakeGraphs(gpu)
    timed = TimedGraph(timer, make_step(timer, gpu, mode), period=4, graphs=graphs, warm_up=0)
    assert timed.regions == 2
    timed.replay()
    assert timer.flush(5)  # the device's first use: its pool is made and its baseline calibrated
    records_before = gpu.records
    for _ in range(39):
        assert timed.replay() == "output"
        assert timer.flush(5)
    # Untimed replays ran graph 0; timed ones a timed copy (1 or 2), every 4th replay.
    assert [g != 0 for g in graphs.replays] == [i % 4 == 0 for i in range(40)]
    assert timed.timed_replays == 10
    assert gpu.records - records_before == 9  # one fence per timed replay: no CPU work per region
    assert (count(registry, "attn"), count(registry, "mlp")) == (10, 10)
    baseline = timer.resolver.baseline_s[0]
    # Each region spans its work plus one node gap (exact pairs) or boundary gap (sequence),
    # less the eager baseline (one record gap): the work itself.
    assert mean(registry, "attn") == pytest.approx(WORK["attn"] + gpu.step - baseline, abs=1e-9)
    assert mean(registry, "mlp") == pytest.approx(WORK["mlp"] + gpu.step - baseline, abs=1e-9)
    entered = registry.get_sample_value("gpuscope_regions_entered_total", {"op": "attn"})
    assert entered == 40 - 3  # counted when a timed replay is read (the last read was replay 37)


def test_a_copy_is_never_replayed_before_its_last_replay_was_read(make_timer, registry):
    gpu = GraphGpu()
    timer = make_timer(route=gpu, sample_rate=1.0, calibrate_every=0, resolve_interval=30.0)
    graphs = FakeGraphs(gpu)
    timed = TimedGraph(timer, make_step(timer, gpu), period=1, copies=2, graphs=graphs, warm_up=0)
    gpu.ready = False  # the GPU is behind: no fence completes
    for _ in range(6):
        timed.replay()
    # Two copies were replayed once each; the other four replays ran untimed and were counted.
    assert graphs.replays == [1, 2, 0, 0, 0, 0]
    assert timer.dropped["graph_busy"] == 4
    gpu.ready = True
    assert timer.flush(5)
    assert count(registry, "attn") == 2
    assert mean(registry, "attn") == pytest.approx(WORK["attn"] + gpu.step - timer.resolver.baseline_s[0])
    timed.replay()
    assert graphs.replays[-1] == 1  # freed by the read, so timed again


def test_several_graphs_share_a_timer(make_timer, registry):
    gpu = GraphGpu()
    timer = make_timer(route=gpu, sample_rate=1.0, calibrate_every=0)
    graphs = FakeGraphs(gpu)
    small = TimedGraph(timer, make_step(timer, gpu), period=1, graphs=graphs, warm_up=0)
    large = TimedGraph(timer, make_step(timer, gpu), period=2, graphs=graphs, warm_up=0)
    for _ in range(10):
        small.replay()
        large.replay()
        assert timer.flush(5)
    assert (small.timed_replays, large.timed_replays) == (10, 5)
    assert count(registry, "attn") == 10 + 5


def test_the_untimed_capture_counts_no_drop_and_eager_regions_are_unaffected(make_timer, registry):
    gpu = GraphGpu()
    timer = make_timer(route=gpu, sample_rate=1.0, calibrate_every=0)
    TimedGraph(timer, make_step(timer, gpu), period=1, graphs=FakeGraphs(gpu), warm_up=0)
    assert timer.dropped["graph_capture"] == 0
    with timer.region("eager"):
        gpu.work(5e-6)
    assert timer.flush(5)
    assert count(registry, "eager") == 1


def test_the_torch_route_is_refused_with_a_reason(make_timer):
    class TorchLike(ScriptedRoute):
        name = "torch"

    timer = make_timer(route=TorchLike())
    with pytest.raises(ValueError, match="cudart-ctypes or cuda-bindings"):
        TimedGraph(timer, lambda: None, graphs=object(), warm_up=0)
