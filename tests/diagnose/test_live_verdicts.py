"""Every verdict, end to end: fake NVML under the exporter's real code, a fake host, a fake /metrics.

Each case sets the GPUs, the host and the server, samples a short live window through
``LiveSampler`` and asserts which findings come out (and that a healthy box gets none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from gpuscope.diagnose.gpus import GpuSampler
from gpuscope.diagnose.live import LiveSampler, Window
from gpuscope.diagnose.verdicts import judge
from tests.diagnose.fakes import FakeHost, Server
from tests.nvml.fake_nvml import FakeGpu, FakeNvml

GIB = 2**30


@dataclass
class Case:
    gpus: list[FakeGpu]
    host: FakeHost
    server: Server | None = None
    #: Called after each tick with the fake NVML, the tick's index and the share of the window done.
    during: Callable[[FakeNvml, int, float], None] | None = None
    expected: set[str] = field(default_factory=set)


def _serving(server: Server, itl: float = 0.02) -> Server:
    def step(s: Server) -> None:
        s.of("running").set(1)
        s.of("tokens").inc(10)
        for _ in range(10):
            s.of("itl").observe(itl)
        s.of("ttft").observe(0.05)
        s.of("queue").observe(0.001)
    server.steps.append(step)
    return server


def _queueing(server: Server) -> Server:
    def step(s: Server) -> None:
        s.of("running").set(8)
        s.of("waiting").set(6)
        s.of("tokens").inc(80)
        s.of("ttft").observe(2.0)
        s.of("queue").observe(1.8)
        s.of("itl").observe(0.03)
    server.steps.append(step)
    return server


def _preempting(server: Server) -> Server:
    def step(s: Server) -> None:
        s.of("running").set(30)
        s.of("kv").set(0.99)
        s.of("preemptions").inc(2)
        s.of("tokens").inc(300)
    server.steps.append(step)
    return server


def _launch_bound_ops(server: Server) -> Server:
    def step(s: Server) -> None:
        s.of("busy", op="model.layers.0.mlp", device="cuda:0").set(0.2)
        s.of("busy", op="lm_head", device="cuda:0").set(0.95)
        for _ in range(5):
            s.of("region", op="model.layers.0.mlp", device="cuda:0").observe(0.0004)
    server.steps.append(step)
    return server


def _swing(nv: FakeNvml, tick: int, share: float) -> None:
    nv.gpus[0].util_gpu = 100 if share < 0.5 else 0


def _leak(nv: FakeNvml, tick: int, share: float) -> None:
    nv.gpus[0].mem_used += 3 * GIB


def _xid(nv: FakeNvml, tick: int, share: float) -> None:
    if tick == 1:
        nv.inject_xid(0, 79)


CASES = {
    "healthy": Case([FakeGpu(util_gpu=85)], FakeHost(0.5), _serving(Server())),
    "input_bound": Case([FakeGpu(util_gpu=10)], FakeHost(0.96), expected={"input_bound"}),
    "memory_pressure": Case([FakeGpu(mem_used=137 * GIB, util_gpu=100)], FakeHost(0.3), during=_swing,
                            expected={"memory_pressure"}),
    "hidden_sync": Case([FakeGpu(util_gpu=12)], FakeHost(0.08, busiest_core=0.97), _serving(Server()),
                        expected={"hidden_sync"}),
    "launch_bound_ops": Case([FakeGpu(util_gpu=70)], FakeHost(0.5), _launch_bound_ops(_serving(Server())),
                             expected={"launch_bound_ops"}),
    "queueing": Case([FakeGpu(util_gpu=95)], FakeHost(0.5), _queueing(Server()), expected={"queueing"}),
    "kv_preemption_vllm": Case([FakeGpu(util_gpu=95)], FakeHost(0.5), _preempting(Server(vllm=True)),
                               expected={"kv_preemption"}),
    "thermal_throttling": Case([FakeGpu(util_gpu=95, clock_reasons=0x40)], FakeHost(0.5),
                               expected={"thermal_throttling"}),
    "power_throttling": Case([FakeGpu(util_gpu=95, clock_reasons=0x4)], FakeHost(0.5),
                             expected={"power_throttling"}),
    "xid": Case([FakeGpu(util_gpu=95), FakeGpu(util_gpu=95)], FakeHost(0.5), during=_xid, expected={"xid"}),
    "memory_leak": Case([FakeGpu(util_gpu=95, mem_used=20 * GIB)], FakeHost(0.5), during=_leak,
                        expected={"memory_leak"}),
}


def sample(case: Case, url: str | None, duration: float = 1.2, interval: float = 0.1) -> Window:
    nv = FakeNvml(case.gpus)
    gpus = GpuSampler(interval=0.05, nv=nv, xid_wait_ms=20)
    sampler = LiveSampler(duration, interval, url, gpu_sampler=gpus, host_sampler=case.host)  # type: ignore[arg-type]

    def on_tick(window: Window, share: float) -> None:
        if case.during is not None:
            case.during(nv, len(window.ticks), share)

    return sampler.run(on_tick)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_verdict_from_fake_gpus_host_and_metrics(name: str) -> None:
    case = CASES[name]
    if case.server is not None:
        with case.server.serve() as url:
            window = sample(case, url)
    else:
        window = sample(case, None)
    summary = window.summary("testhost")
    findings = judge(summary)
    codes = {f.code for f in findings}
    assert codes == case.expected, (codes, summary)
    for f in findings:  # every finding names its numbers and a next step
        assert f.evidence and f.next_step
    if name == "xid":
        assert summary.gpus[0].xids == {"79": 1.0} and not summary.gpus[1].xids
        assert "drain" in findings[0].title  # 79 (fallen off the bus) is a hardware XID
    if name == "memory_pressure":
        assert findings[0].severity == "problem" and (summary.gpus[0].util_swing or 0) >= 0.3
    if name == "kv_preemption_vllm":
        assert summary.server is not None and summary.server.source == "vllm"
        assert (summary.server.preemptions or 0) > 0


def test_memory_full_without_swing_is_only_a_warning() -> None:
    case = Case([FakeGpu(mem_used=137 * GIB, util_gpu=90)], FakeHost(0.3))
    findings = judge(sample(case, None, duration=0.6).summary())
    assert [(f.code, f.severity) for f in findings] == [("memory_pressure", "warning")]


def test_unreachable_default_server_is_reported_not_judged() -> None:
    case = Case([FakeGpu(util_gpu=50)], FakeHost(0.3))
    summary = sample(case, "http://127.0.0.1:9/metrics", duration=0.3).summary()
    assert summary.server is None
    assert any("127.0.0.1:9" in u for u in summary.unavailable)
    assert summary.gpus and summary.gpus[0].util_mean == pytest.approx(0.5)
    assert judge(summary) == []  # tried on the chance a server runs there: silence is no finding
