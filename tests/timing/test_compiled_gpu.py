"""instrument() on compiled models on a real GPU: default torch.compile and CUDA graph trees."""

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch._dynamo.utils import counters

from gpuscope.timing import Timer

pytestmark = pytest.mark.gpu


class Model(torch.nn.Module):
    def __init__(self, d: int = 1024) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def samples(timer: Timer) -> dict[str, int]:
    return {op.name: sum(h.count for h in op.hists.values()) for op in timer.core.ops()}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_model_is_timed_without_graph_breaks(mode):
    torch.manual_seed(0)
    model = Model().cuda().to(torch.bfloat16).eval()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    with Timer(CollectorRegistry(), sample_rate=1.0, calibrate_every=0) as timer, torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, mode=mode)
        inst = timer.instrument(compiled, include=("attn", "mlp"))
        outputs = []
        for _ in range(12):
            outputs.append(compiled(x).clone())
            torch.cuda.synchronize()
            assert timer.flush(30)  # read before the next pass: every pass can be timed
        assert not counters["graph_break"], dict(counters["graph_break"])
        for out in outputs:
            torch.testing.assert_close(out, expected, atol=0.05, rtol=0.05)  # Inductor's own rounding
        assert all(torch.equal(out, outputs[-1]) for out in outputs[3:])  # timed passes change no value
        got = samples(timer)
        merged = inst.compiled.merged()
        timed = [name for name in ("attn", "mlp") if not any(name in g for g in merged)]
        for name in timed:
            assert got[name] >= 8, (name, got)
        if mode == "reduce-overhead":
            shapes = next(iter(inst.compiled._shapes.values()))
            assert shapes.events, "the timed CUDA graph holds no event nodes"
        assert timer.dropped["error"] == 0
        inst.remove()


class Layer(torch.nn.Module):
    def __init__(self, d: int = 1024) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.lin(x))


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_chain_shares_one_event_per_boundary(mode):
    """Layer i's end and layer i+1's start touch: N + 1 events (or event nodes) for N layers, every
    layer still timed, and every pooled event back once."""
    n = 4
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Layer() for _ in range(n))).cuda().to(torch.bfloat16).eval()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with Timer(CollectorRegistry(), sample_rate=1.0, calibrate_every=0) as timer, torch.no_grad():
        compiled = torch.compile(model, mode=mode)
        inst = timer.instrument(compiled, include=tuple(str(i) for i in range(n)))
        records = []
        for _ in range(12):
            compiled(x)
            records.append(inst.compiled.marks.records)
            torch.cuda.synchronize()
            assert timer.flush(30)
        merged = inst.compiled.merged()
        got = samples(timer)
        if not merged:
            assert all(got[str(i)] >= 8 for i in range(n)), got
            if mode == "default":
                assert records[-1] == n + 1, records
            else:
                shapes = next(iter(inst.compiled._shapes.values()))
                assert shapes.nodes == n + 1, shapes.events
        assert timer.dropped["error"] == 0
        pool = timer.core.pools[timer.core.current_device()]
        assert len({id(event) for event in pool}) == len(pool) == timer.core.pool_size
        inst.remove()


def test_cuda_graph_kernels_are_attributed_to_the_modules_captured_around_them():
    """Under CUDA graph trees, a kernel busy window gives each module its own kernel time: the graph
    nodes were labelled at capture (CUPTI callbacks) and the replay's kernel records summed."""
    pytest.importorskip("cupti")
    torch.manual_seed(0)
    model = Model().cuda().to(torch.bfloat16).eval()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with Timer(CollectorRegistry(), sample_rate=1.0, calibrate_every=0) as timer, torch.no_grad():
        busy = timer.enable_kernel_busy(min_interval_s=0.0, budget_share=1.0)
        assert busy.labels is not None, "CUPTI's graph-node callbacks could not be subscribed"
        compiled = torch.compile(model, mode="reduce-overhead")
        inst = timer.instrument(compiled, include=("attn", "mlp"))
        for _ in range(16):
            compiled(x)
            torch.cuda.synchronize()
            assert timer.flush(30)
            busy.expire()
        assert busy.labels.callback_errors == 0
        assert busy.labels.labels, "no kernel node was labelled at capture"
        assert busy.windows["ok"] >= 1, busy.windows
        merged = inst.compiled.merged()
        for name in ("attn", "mlp"):
            if any(name in g for g in merged):
                continue
            kernel_s = busy.kernel_seconds[(name, "0")]
            region_s = sum(h.sum for h in timer.core.op_state(name).hists.values()) / samples(timer)[name]
            assert 0 < kernel_s <= region_s * 1.05, (name, kernel_s, region_s)
            assert 0 < busy.ratios[(name, "0")] <= 1
        inst.remove()
