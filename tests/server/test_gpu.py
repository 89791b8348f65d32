"""On a CUDA GPU: the server's model runs there, its steps and modules are timed with CUDA events."""

from __future__ import annotations

import pytest

from tests.conftest import wait_for

pytestmark = pytest.mark.gpu


def test_engine_on_cuda_times_modules_and_charges_tenants():
    import torch
    from prometheus_client import CollectorRegistry

    from gpuscope.server.config import ModelSpec, parse_tenants
    from gpuscope.server.engine import Engine, Request
    from gpuscope.server.metrics import RequestMetrics, StateCollector
    from gpuscope.server.model import build_model, encode
    from gpuscope.server.scheduler import Scheduler
    from gpuscope.server.step_timing import build_timer, instrument_model

    registry = CollectorRegistry()
    model = build_model(ModelSpec(layers=4, dim=512, heads=8, context=512))
    assert next(model.parameters()).device.type == "cuda"
    timer = build_timer("all", registry)
    inst = instrument_model(timer, model)
    scheduler = Scheduler(parse_tenants("a:0.7,b:0.3"), "share", 100)
    engine = Engine(model, scheduler, timer, batch_size=8, max_wait_s=0.005, deliver=lambda events: None,
                    metrics=RequestMetrics(registry, ["a", "b"]), log_requests=False)
    registry.register(StateCollector(scheduler, torch.device("cuda", 0), engine.kv_usage,
                                     lambda: {}))
    engine.start()
    try:
        reqs = [Request("a" if i % 2 else "b", encode("gpu prompt"), 32, 0.0) for i in range(16)]
        for r in reqs:
            engine.submit(r)
        wait_for(lambda: all(r.outcome for r in reqs), timeout=60, what="16 requests on the GPU")
        assert {r.outcome for r in reqs} <= {"length", "stop"}
        timer.flush(10)
        for op in ("prefill", "decode", "blocks.0.attn", "blocks.3.mlp", "lm_head"):
            count = registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": "0"})
            assert count and count > 0, op
        assert registry.get_sample_value("gpuscope_tenant_gpu_seconds_total", {"tenant": "a"}) > 0
        allocated = registry.get_sample_value("gpuscope_device_memory_allocated_bytes", {"device": "cuda:0"})
        total = registry.get_sample_value("gpuscope_device_memory_total_bytes", {"device": "cuda:0"})
        assert 0 < allocated < total
    finally:
        engine.stop()
        inst.remove()
        timer.close()


def test_attention_never_takes_the_per_shape_planning_backend():
    """cuDNN attention plans each new shape (~58 ms a decode step on the H200); serving makes one per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpuscope.server.config import ModelSpec
    from gpuscope.server.model import build_model

    model = build_model(ModelSpec(layers=2, dim=256, heads=4, context=256))
    model.allocate_cache(4)
    dev = next(model.parameters()).device

    def step(rows: int, width: int, span: int) -> None:
        tokens = torch.full((rows, width), 65, dtype=torch.long, device=dev)
        slots = torch.arange(rows, device=dev)
        start = torch.full((rows,), span - width, dtype=torch.long, device=dev)
        model(tokens, slots, start, torch.full((rows,), width - 1, device=dev), span).float().cpu()

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step(3, 17, 17)  # prefill
        for span in range(40, 44):
            step(2, 1, span)  # decode
    names = {event.key for event in prof.key_averages()}
    assert any("scaled_dot_product" in name for name in names), sorted(names)
    assert not [name for name in names if "cudnn_attention" in name]


def test_an_engine_on_the_second_gpu_times_its_steps_there():
    import torch
    from prometheus_client import CollectorRegistry

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from gpuscope.server.config import ModelSpec, parse_tenants
    from gpuscope.server.engine import Engine, Request
    from gpuscope.server.model import build_model, encode
    from gpuscope.server.scheduler import Scheduler
    from gpuscope.server.step_timing import build_timer

    registry = CollectorRegistry()
    model = build_model(ModelSpec(layers=2, dim=256, heads=4, context=256, device="cuda:1"))
    timer = build_timer("all", registry)
    scheduler = Scheduler(parse_tenants("a:1"), "share", 100)
    engine = Engine(model, scheduler, timer, batch_size=4, max_wait_s=0.005, deliver=lambda events: None,
                    log_requests=False)
    engine.start()
    try:
        reqs = [Request("a", encode("second gpu"), 16, 0.0) for _ in range(4)]
        for r in reqs:
            engine.submit(r)
        wait_for(lambda: all(r.outcome for r in reqs), timeout=60, what="4 requests on cuda:1")
        timer.flush(10)
        on_1 = registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": "decode", "device": "1"})
        on_0 = registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": "decode", "device": "0"})
        assert on_1 and on_1 > 0 and not on_0, (on_0, on_1)
    finally:
        engine.stop()
        timer.close()


def test_decode_steps_replayed_from_cuda_graphs_give_the_eager_tokens_and_module_times():
    """``--model.cuda-graphs``: greedy completions equal eager decoding's, for batches that pad to a
    captured size, and per-module GPU time comes from sampled replays."""
    import torch
    from prometheus_client import CollectorRegistry

    from gpuscope.server.config import ModelSpec, parse_tenants
    from gpuscope.server.engine import Engine, Request
    from gpuscope.server.model import TinyRunner, build_model, encode
    from gpuscope.server.scheduler import Scheduler
    from gpuscope.server.step_timing import build_timer

    def run(cuda_graphs: bool) -> tuple[list[list[int]], CollectorRegistry, object]:
        registry = CollectorRegistry()
        runner = TinyRunner(build_model(ModelSpec(layers=4, dim=256, heads=4, context=256)))
        timer = build_timer("budget", registry)
        inst = runner.instrument(timer)
        if cuda_graphs:
            runner.use_cuda_graphs(timer)
        engine = Engine(runner, Scheduler(parse_tenants("a:1"), "share", 100), timer, batch_size=8,
                        max_wait_s=0.005, deliver=lambda events: None, log_requests=False)
        engine.start()
        try:
            # 5 rows pad to the captured size 8, then fewer as requests of different lengths end.
            reqs = [Request("a", encode(f"prompt {i}"), 8 + 6 * i, 0.0) for i in range(5)]
            for r in reqs:
                engine.submit(r)
            wait_for(lambda: all(r.outcome for r in reqs), timeout=120, what="requests done")
            assert timer.flush(30)
            return [r.generated for r in reqs], registry, runner
        finally:
            engine.stop()
            inst.remove()
            timer.close()

    eager, _, _ = run(cuda_graphs=False)
    graphed, registry, runner = run(cuda_graphs=True)
    assert graphed == eager
    assert runner.decode_graphs.sizes == [1, 2, 4, 8]
    replays = sum(g.replays for g in runner.decode_graphs.timed_graphs())
    timed = sum(g.timed_replays for g in runner.decode_graphs.timed_graphs())
    assert replays > 0 and timed > 0
    labels = {"op": "blocks.0.attn", "device": "0"}
    count = registry.get_sample_value("gpuscope_region_gpu_seconds_count", labels)
    assert count and count >= timed
    torch.cuda.synchronize()
