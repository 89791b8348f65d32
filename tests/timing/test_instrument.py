import pytest
import torch

from gpuscope.timing import instrument
from tests.timing.conftest import ScriptedRoute, prepared


class Block(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.attn = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU())

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(self.norm(x))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), Block(), Block())


def counts(registry, ops):
    return {op: registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": "cpu"})
            for op in ops}


def test_exact_mode_times_default_modules_by_path_and_keeps_outputs(make_timer, registry):
    timer = make_timer(sample_rate=1.0)
    m = model()
    x = torch.randint(0, 32, (2, 5))
    expected = m(x)
    inst = timer.instrument(m)
    assert inst.ops == ["0", "1.attn", "1.mlp", "2.attn", "2.mlp"]
    for _ in range(3):
        assert torch.equal(m(x), expected)
    assert timer.flush(5)
    assert set(counts(registry, inst.ops).values()) == {3}
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules()), \
        "instrument() must not use forward hooks (they cost even when empty, docs/design.md)"
    inst.remove()
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    m(x)
    assert timer.flush(5)
    assert set(counts(registry, inst.ops).values()) == {3}


def test_partition_mode_uses_n_plus_one_records_per_forward(make_timer, registry):
    route = ScriptedRoute()
    timer = prepared(make_timer(route=route, sample_rate=1.0))
    m = model()
    inst = timer.instrument(m, include=("attn", "mlp"), mode="partition")
    assert inst.ops == ["1.attn", "1.mlp", "2.attn", "2.mlp"]
    before = route.records
    m(torch.randint(0, 32, (2, 5)))
    assert route.records - before == 5
    assert timer.flush(5)
    assert set(counts(registry, inst.ops).values()) == {1}
    inst.remove()


def test_include_patterns_predicates_and_op_names(make_timer, registry):
    timer = make_timer(sample_rate=1.0)
    m = model()
    inst = timer.instrument(m, include="*.mlp", op_name=lambda path: "mlp")
    assert inst.ops == ["mlp", "mlp"]
    inst.remove()
    inst = timer.instrument(m, include=lambda path, mod: isinstance(mod, torch.nn.LayerNorm))
    assert inst.ops == ["1.norm", "2.norm"]
    inst.remove()
    with pytest.raises(ValueError, match="no submodule matched"):
        timer.instrument(m, include=("nothing_here",))
    with pytest.raises(ValueError, match="mode"):
        instrument(timer, m, mode="fast")


def test_sampled_out_forwards_only_count(make_timer, registry):
    timer = make_timer(sample_rate=0.5)
    m = model()
    inst = timer.instrument(m, include=("attn",))
    for _ in range(10):
        m(torch.randint(0, 32, (1, 3)))
    assert timer.flush(5)
    assert registry.get_sample_value("gpuscope_regions_entered_total", {"op": "1.attn"}) == 10
    assert counts(registry, ["1.attn"])["1.attn"] == 5
    inst.remove()


class Probe(torch.nn.Module):
    """Records, on every call, whether a per-module wrapper was in place."""

    def __init__(self):
        super().__init__()
        self.wrapped = []

    def forward(self, x):
        self.wrapped.append("forward" in self.__dict__)
        return x


def test_unsampled_passes_run_without_module_wrappers(make_timer, registry):
    timer = make_timer(sample_rate=0.25)
    probe = Probe()
    m = torch.nn.Sequential(torch.nn.Identity(), probe)
    inst = timer.instrument(m, include=("1",))
    for _ in range(8):
        m(torch.zeros(1))
    assert probe.wrapped == [True, False, False, False] * 2
    assert inst.passes == 8 and inst.sampled_passes == 2
    assert timer.flush(5)
    assert registry.get_sample_value("gpuscope_regions_entered_total", {"op": "1"}) == 8
    assert registry.get_sample_value("gpuscope_timer_sampling_ratio", {"op": "1"}) == 0.25
    inst.remove()


def test_pass_cost_is_the_difference_of_sampled_and_unsampled_means():
    from gpuscope.timing.instrument import MIN_COST_MEASUREMENTS, PassCost

    cost = PassCost()
    for _ in range(MIN_COST_MEASUREMENTS - 1):
        cost.add(True, 1_300_000)
        cost.add(False, 1_000_000)
    assert cost.per_sampled_pass_s() is None  # not enough measurements yet
    cost.add(True, 1_300_000)
    cost.add(False, 1_000_000)
    assert cost.per_sampled_pass_s() == pytest.approx(300e-6)


def test_pass_cost_charges_the_passes_after_a_run_to_the_run():
    from gpuscope.timing.instrument import MIN_COST_MEASUREMENTS, PassCost

    cost = PassCost()
    for _ in range(MIN_COST_MEASUREMENTS):
        cost.add(True, 1_300_000)
        cost.add(False, 1_000_000)
    cost.begin_after()
    cost.add_after(1_800_000, 0)  # 800 µs over an unsampled pass, then two ordinary ones
    cost.add_after(1_000_000, 0)
    cost.add_after(1_000_000, 4)  # the window closes: shared by the run's 4 passes
    assert cost.per_sampled_pass_s() == pytest.approx(300e-6 + 200e-6)
    cost.begin_after()  # a window cut short by the next run is dropped
    cost.add_after(9_000_000, 0)
    cost.begin_after()
    cost.add_after(1_000_000, 4)
    assert cost.n_after == 2 and cost.per_sampled_pass_s() == pytest.approx(300e-6 + 0.95 * 200e-6)
    for _ in range(100):  # passes after runs faster than the unsampled mean: noise, not a refund
        cost.begin_after()
        cost.add_after(600_000, 1)
    assert cost.after_ns < 0 and cost.per_sampled_pass_s() == pytest.approx(300e-6)


def test_instrumenting_twice_is_refused(make_timer):
    timer = make_timer(sample_rate=1.0)
    m = model()
    inst = timer.instrument(m)
    with pytest.raises(ValueError, match="already instrumented"):
        timer.instrument(m)
    inst.remove()
    timer.instrument(m).remove()


class Inner(torch.nn.Module):
    """A module whose forward takes positional and keyword arguments, and can fail."""

    def forward(self, x, bias, *, scale=1.0, fail=False):
        if fail:
            raise ValueError("bad input in the module")
        return x * scale + bias


@pytest.mark.parametrize("mode", ["exact", "partition"])
def test_module_forwards_pass_arguments_through_and_end_regions_on_errors(make_timer, registry, mode):
    """What instrument() puts in place of a module's forward (in C on the C hot path) hands the
    module every positional and keyword argument, returns its result, and lets its exception
    through with the region ended: the next pass times normally."""
    timer = make_timer(sample_rate=1.0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Inner()

        def forward(self, x, fail=False):
            return self.attn(x, 1.0, scale=2.0, fail=fail)

    model = Model()
    inst = timer.instrument(model, include=("attn",), mode=mode)
    x = torch.ones(3)
    assert torch.equal(model(x), torch.full((3,), 3.0))
    with pytest.raises(ValueError, match="bad input in the module"):
        model(x, fail=True)
    assert torch.equal(model(x), torch.full((3,), 3.0))
    assert timer.flush(5)
    assert counts(registry, ["attn"]) == {"attn": 3}
    assert timer.dropped["error"] == 0
    inst.remove()
