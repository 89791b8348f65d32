#!/usr/bin/env python3
"""The timer on compiled models: throughput against an untimed twin, graph breaks, merges, accuracy.

Workloads (bf16, one GPU, random weights, nothing downloaded):

- ``encoder``: ``nn.TransformerEncoder``, 6 layers, d 512, 8 heads, batch 16 × 256; each layer a region;
- ``llama-prefill`` / ``llama-decode``: a Llama-shaped decoder built from ``transformers``'
  ``LlamaConfig`` (8 layers, d 1024, 16 heads, 8 KV heads), prefill 4 × 512 tokens and a batch-1
  one-token step (no KV cache: the launch-bound shape of a decode step); regions: embedding, each
  layer's attention and MLP, the head;
- ``resnet50``: torchvision's ResNet-50, batch 32 × 224², channels-last; regions: every top-level
  child (stem, the four stages, pooling, head).

For each workload and each mode (``torch.compile`` default, ``mode="reduce-overhead"``; also ``eager``
and ``attribution``, below): the model is
compiled twice, an untimed twin and the instrumented copy (``torch.compile(m)`` then
``timer.instrument(compiled)``). Throughput in interleaved paired rounds (the order alternates each
round): twin vs instrumented at the default budget, then twin vs instrumented with every pass
sampled; reported as medians of the paired ratios with quartiles. Each is measured a second way
(``*_same_model``): the instrumented model against itself with the timer detached for the
segment, so the same compiled code runs in both halves (two untimed twins differ by up to a few %
from their own compiles, more than the 1% budget being checked), and a third way (``*_fine``,
``--fine-s``): the same model detached, in short blocks alternating for a few seconds, the loss from
the summed times, which a noisy host's slow spells hit on both sides alike. Also: graph breaks counted by
dynamo while compiling and running the instrumented model, the regions Inductor's fusion merged,
the budget's sampling period, and regions vs CUPTI (torch.profiler) kernel time over the same passes
(every pass timed, each read before the next; regions cover only the instrumented modules, so glue
kernels outside them are in CUPTI's sum only).

Two more modes. ``eager``: the uncompiled model instrumented, default budget and every pass sampled
against itself detached, with what a timed pass adds in µs per pass and per region (the same cost
is a larger share of a shorter compiled pass). ``attribution``: under CUDA graph trees with the
kernel busy window on, each region's kernel time from CUPTI's records of a traced replay
(``gpuscope_region_kernel_seconds``) against its event time and against all the replay's kernel
time (needs ``cupti-python``).

And ``parts``: where a fully sampled pass's cost goes under default compile (``run_parts``): the
timer detached, every pass timed, and every pass through the timed graph with its markers disarmed,
each with the launching thread's CPU a pass; with ``--profile-segments N``, also N segments of
detached and of disarmed under cProfile (the functions with the most time of their own a pass). Its
fourth variant, ``sparse``, times every ``--sparse-period``-th pass as the budget would: the cost of
a timed pass there against every pass timed and against the budget's own estimate, and each pass's
wall time by its place after the timed one (which pass pays for the switch between the graphs).

Writes ``--out`` after every workload (partial results survive a time limit); a table last.

    python benchmarks/compile_timing_bench.py --out benchmarks/results/timer-compile-h200.json
    python benchmarks/compile_timing_bench.py --workloads encoder --modes default --rounds 4
    python benchmarks/compile_timing_bench.py --out X --modes eager,attribution
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from benchlib import logger, rnd, write_json  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from gpuscope.timing import Timer, fusion  # noqa: E402

log = logger("compile_timing_bench")
DTYPE = torch.bfloat16
DEVICE = "cuda"  # --device cpu: a smoke test of the script itself (Inductor's C++ backend)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def encoder() -> tuple:
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
    x = torch.randn(16, 256, 512, device=DEVICE, dtype=DTYPE)
    return model, (x,), {}, lambda path, m: isinstance(m, torch.nn.TransformerEncoderLayer)


def llama(tokens: tuple[int, int]) -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=2048)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, tokens, device=DEVICE)
    return model, (), {"input_ids": ids, "use_cache": False}, ("embed_tokens", "self_attn", "mlp", "lm_head")


def resnet50() -> tuple:
    import torchvision

    model = torchvision.models.resnet50(weights=None)
    x = torch.randn(32, 3, 224, 224, device=DEVICE, dtype=DTYPE).to(memory_format=torch.channels_last)
    top = {"conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"}
    return model, (x,), {}, lambda path, m: path in top


def vit() -> tuple:
    """A model class the budget's unseen-cost factor was not fitted to (torchvision's ViT-B/16)."""
    import torchvision

    model = torchvision.models.vit_b_16(weights=None)
    x = torch.randn(16, 3, 224, 224, device=DEVICE, dtype=DTYPE)
    return model, (x,), {}, lambda path, m: path.startswith("encoder.layers.") and path.count(".") == 2


def vit_sublayers() -> tuple:
    """The same ViT timed by its layers' attention and MLP modules: at layer level each layer's closing
    residual add is fused with the next layer's first norm, and every layer merges into one region."""
    model, call_args, call_kwargs, _ = vit()
    return model, call_args, call_kwargs, lambda path, m: path.startswith("encoder.layers.") and (
        path.endswith(".self_attention") or path.endswith(".mlp"))


def bert() -> tuple:
    """Another class outside the fit: a Hugging Face BERT-base encoder, batch 8 of 128 tokens."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig())
    ids = torch.randint(0, 30522, (8, 128), device=DEVICE)
    return model, (), {"input_ids": ids}, ("attention", "intermediate")


WORKLOADS = {"encoder": encoder, "llama-decode": lambda: llama((1, 1)),
             "llama-prefill": lambda: llama((4, 512)), "resnet50": resnet50, "vit": vit,
             "vit-sublayers": vit_sublayers, "bert": bert}


def main_tensor(out: object) -> torch.Tensor:
    """A model's output tensor: Hugging Face models return an output object around it."""
    for name in ("logits", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name)
    return out


def rate(fn, steps: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return steps / (time.perf_counter() - t0)


def quartiles(values: list[float]) -> dict:
    if len(values) < 2:
        return {"median": rnd(values[0], 4) if values else None}
    q = statistics.quantiles(values, n=4)
    return {"median": rnd(statistics.median(values), 4), "q1": rnd(q[0], 4), "q3": rnd(q[2], 4),
            "min": rnd(min(values), 4), "max": rnd(max(values), 4)}


def paired(twin, inst_fn, steps: int, rounds: int, inst=None) -> dict:
    """Paired rounds of ``inst_fn`` ("on") against ``twin`` ("off"). With ``inst``, "off" is the
    same compiled model with the timer detached for the segment: the same compiled code runs in
    both, so the twin's own compile (its kernel choices, up to a few % apart) is out of the ratio."""
    ratios, on, off = [], [], []

    def segment(name: str, fn) -> float:
        if inst is None or name == "on":
            return rate(fn, steps)
        inst.detach()
        try:
            return rate(fn, steps)
        finally:
            inst.attach()

    for i in range(rounds):
        pair = [("on", inst_fn), ("off", twin)]
        if i % 2:
            pair.reverse()
        got = {name: segment(name, fn) for name, fn in pair}
        on.append(got["on"])
        off.append(got["off"])
        ratios.append(got["on"] / got["off"])
    loss = [1 - r for r in ratios]
    return {"loss": quartiles(loss), "untimed_steps_per_s": rnd(statistics.median(off), 1),
            "instrumented_steps_per_s": rnd(statistics.median(on), 1), "rounds": rounds}


def fine_same_model(fn, inst, seconds: float, steps: int, groups: int = 8) -> dict:
    """The instrumented model against itself detached, in short blocks alternating ABBA for
    ``seconds``: a noisy host's slow spells (CPU steal, neighbours) outlast a block, so both halves
    share them, where 0.2 s segments took them one at a time (quartiles of ±5-40% on an H100). The
    loss comes from the summed times, so blocks with no timed pass in them count as they should at a
    long sampling period (a median of block ratios would not); quartiles over ``groups`` stretches."""
    block = max(8, steps // 8)
    on_ns: list[int] = []
    off_ns: list[int] = []
    clock = time.perf_counter_ns
    deadline = time.perf_counter() + seconds
    index = 0
    sampled0 = inst.sampled_passes
    while time.perf_counter() < deadline or len(on_ns) < groups:
        for name in ("on", "off") if index % 2 == 0 else ("off", "on"):
            if name == "off":
                inst.detach()
            try:
                sync()
                t0 = clock()
                for _ in range(block):
                    fn()
                sync()
                spent = clock() - t0
            finally:
                if name == "off":
                    inst.attach()
            (on_ns if name == "on" else off_ns).append(spent)
        index += 1
    size = len(on_ns) // groups
    losses = [1 - sum(off_ns[g * size:(g + 1) * size]) / sum(on_ns[g * size:(g + 1) * size])
              for g in range(groups)]
    return {"loss_total": rnd(1 - sum(off_ns) / sum(on_ns), 4), "loss": quartiles(losses),
            "blocks": len(on_ns), "passes_per_block": block,
            # at a long period a few runs of timed passes fall in the blocks: the loss is as good as
            # the number of them (the budget's cycle is 8 periods of passes)
            "timed_passes": inst.sampled_passes - sampled0}


def _is_kernel(event) -> bool:
    """A GPU kernel's record (memory copies and sets left out)."""
    name = event.name().lower()
    return (event.device_type() == torch.autograd.DeviceType.CUDA
            and "memcpy" not in name and "memset" not in name)


def kernel_count(prof) -> int | None:
    """GPU kernels in a torch.profiler run."""
    try:
        return sum(1 for event in prof.profiler.kineto_results.events() if _is_kernel(event))
    except Exception:
        return None


def kernel_seconds(prof) -> tuple[float, float | None]:
    """(sum of GPU kernel durations, sum over passes of first kernel start to last kernel end) in a
    torch.profiler run (CUPTI's records). Passes are told apart by the idle gap of the synchronize
    and read between them (> PASS_GAP_NS); a region's time is a timeline, gaps between its kernels
    included, which the span counts and the sum does not."""
    spans: list[tuple[int, int]] = []
    total = 0.0
    try:
        for event in prof.profiler.kineto_results.events():
            if not _is_kernel(event):
                continue
            total += event.duration_ns() * 1e-9
            spans.append((event.start_ns(), event.start_ns() + event.duration_ns()))
    except Exception:
        return sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) * 1e-6, None
    spans.sort()
    span_total, first, last = 0, None, None
    for begin, end in spans:
        if last is not None and begin - last > PASS_GAP_NS:
            span_total += last - first
            first = None
        if first is None:
            first = begin
        last = end if last is None or first == begin else max(last, end)
    if first is not None:
        span_total += last - first
    return total, span_total * 1e-9


PASS_GAP_NS = 500_000


def extra_us(same_model: dict) -> float | None:
    """What a timed pass added, in µs of wall time per pass, from the median rates of paired rounds
    of the same model with the timer attached and detached."""
    on, off = same_model["instrumented_steps_per_s"], same_model["untimed_steps_per_s"]
    return rnd((1 / on - 1 / off) * 1e6, 1) if on and off else None


def cost_estimates(inst, budget: dict) -> dict:
    """What a timed pass costs by the instrumentation's running means, on the launching thread's CPU
    (what the budget reads), on the wall clock (``inst.wall_cost``) and over each pass's step to the
    next pass (``inst.step_cost``: with the program's wait for the GPU after the call, where it
    waits each step), and the loss each implies at the share of passes the budget timed: set
    against the fine blocks' measured loss, which clock sees what the timed passes cost."""
    out: dict = {}
    share = budget["timed_passes"] / max(1, budget["passes"])
    pass_s = 1 / budget["untimed_steps_per_s"] if budget.get("untimed_steps_per_s") else None
    # and what the budget charges (the thread's CPU, scaled under default compile on a GPU)
    estimates = {"thread": inst.cost.per_sampled_pass_s(), "wall": inst.wall_cost.per_sampled_pass_s(),
                 "step": inst.step_cost.per_sampled_pass_s(), "charged": inst.sampled_pass_cost_s()}
    for key, per_pass in estimates.items():
        out[f"timed_pass_cost_us_{key}"] = rnd(per_pass * 1e6, 1) if per_pass is not None else None
        out[f"implied_loss_{key}"] = (rnd(per_pass * share / pass_s, 5)
                                      if per_pass is not None and pass_s else None)
    return out


def build(name: str) -> tuple:
    """The workload's model (on the device, bf16, eval) and its call's arguments and regions."""
    torch.manual_seed(0)
    model, call_args, call_kwargs, include = WORKLOADS[name]()
    model = model.to(DEVICE, DTYPE).eval()
    if name == "resnet50":
        model = model.to(memory_format=torch.channels_last)
    return model, call_args, call_kwargs, include


def run_eager(name: str, args: argparse.Namespace) -> dict:
    """The same workload uncompiled, instrumented the eager way: the cost each timed region has
    there, against which the compiled figures are read (a compiled pass is shorter, so the same
    per-region cost is a larger share of it)."""
    model, call_args, call_kwargs, include = build(name)
    timer = Timer(CollectorRegistry(), calibrate_every=0)
    result: dict = {"workload": name, "mode": "eager"}
    with torch.no_grad():
        inst = timer.instrument(model, include=include)

        def run_inst() -> None:
            model(*call_args, **call_kwargs)

        for _ in range(3):
            run_inst()
        steps = max(5, int(args.segment_s * rate(run_inst, 5)))
        result["steps_per_segment"] = steps
        warm_until = time.perf_counter() + args.settle_s
        while time.perf_counter() < warm_until:
            rate(run_inst, steps)
        result["budget_same_model"] = paired(run_inst, run_inst, steps, args.rounds, inst=inst)
        result["budget_same_model"]["period"] = timer.sampling_period()
        timer.core.fixed_rate = True
        timer.core.set_period(1)
        rate(run_inst, steps)
        result["full_same_model"] = paired(run_inst, run_inst, steps, args.rounds, inst=inst)
        result["full_same_model"]["extra_us_per_pass"] = extra_us(result["full_same_model"])
        result["regions"] = len(inst.ops)
        extra = result["full_same_model"]["extra_us_per_pass"]
        if extra is not None:
            result["full_same_model"]["extra_us_per_region"] = rnd(extra / len(inst.ops), 2)
    inst.remove()
    timer.close()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


class _Disarmed:
    """A compiled model's markers left disarmed for a timed pass: the timed graph runs, with its
    marker calls and the sampler's Python, but records no event (each marker returns at its thread
    check)."""

    eager_marks = records = 0

    def __init__(self, marks: object) -> None:
        self._marks = marks

    def arm(self) -> None:
        pass

    def disarm(self) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._marks, name)


def run_parts(name: str, args: argparse.Namespace) -> dict:
    """Where a fully sampled pass's cost goes under default ``torch.compile``: interleaved segments of
    the same compiled model with the timer detached, every pass timed, and every pass through the
    timed graph with its markers disarmed (no events); per segment the wall rate and the launching
    thread's CPU a pass. Run it again under ``GPUSCOPE_TIMING_RECYCLER=0`` to see the recycler's
    part (its CUDA calls run beside the launching thread)."""
    model, call_args, call_kwargs, include = build(name)
    timer = Timer(CollectorRegistry(), calibrate_every=0)
    result: dict = {"workload": name, "mode": "parts", "recycler": timer.core.recycling}
    with torch.no_grad():
        compiled = torch.compile(model)
        inst = timer.instrument(compiled, include=include)
        regions, marks = inst.compiled, inst.compiled.marks

        def run_inst() -> None:
            compiled(*call_args, **call_kwargs)

        for _ in range(8):
            run_inst()
        timer.core.fixed_rate = True
        timer.core.set_period(1)
        steps = max(5, int(args.segment_s * rate(run_inst, 5)))

        by_position: dict[str, dict[int, list[int]]] = {"detached": {}, "sparse": {}}
        estimates: list[float] = []  # the budget's own estimate of a timed pass's cost, per segment
        wall_estimates: list[float] = []  # the same in wall time (inst.wall_cost)

        def segment(variant: str, passes: int = steps) -> tuple[float, float]:
            if variant == "detached":
                inst.detach()
            elif variant == "disarmed":
                regions.marks = _Disarmed(marks)
            elif variant == "sparse":
                timer.core.set_period(args.sparse_period)
                inst.cost.__init__()  # the budget's estimate from this segment's passes alone
                inst.wall_cost.__init__()
                inst.step_cost.__init__()
            cpu0 = time.thread_time()
            try:
                if variant in by_position:
                    steps_per_s = pass_walls(run_inst, inst, passes, by_position[variant],
                                             detached=variant == "detached")
                else:
                    steps_per_s = rate(run_inst, passes)
            finally:
                cpu_us = (time.thread_time() - cpu0) / passes * 1e6
                if variant == "detached":
                    inst.attach()
                regions.marks = marks
                timer.core.set_period(1)
            if variant == "sparse" and inst.cost.per_sampled_pass_s() is not None:
                estimates.append(inst.cost.per_sampled_pass_s())
                wall_estimates.append(inst.wall_cost.per_sampled_pass_s() or 0.0)
            timer.flush(10)
            return steps_per_s, cpu_us

        variants = ("detached", "timed", "disarmed", "sparse")
        got: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for v in variants:  # warm
            segment(v)
        for i in range(args.rounds):
            for v in variants if i % 2 == 0 else variants[::-1]:
                got[v].append(segment(v))
        base_rate = statistics.median(r for r, _ in got["detached"])
        base_cpu = statistics.median(c for _, c in got["detached"])
        for v in variants:
            steps_per_s = statistics.median(r for r, _ in got[v])
            cpu_us = statistics.median(c for _, c in got[v])
            result[v] = {"steps_per_s": rnd(steps_per_s, 1), "loss": rnd(1 - steps_per_s / base_rate, 4),
                         "extra_us_per_pass": rnd((1 / steps_per_s - 1 / base_rate) * 1e6, 1),
                         "thread_cpu_us_per_pass": rnd(cpu_us, 1),
                         "extra_thread_cpu_us": rnd(cpu_us - base_cpu, 1)}
        # at a budget-like period: what each pass costs by its place after the last timed one (0:
        # the timed pass), against a detached pass; a timed pass's cost beyond what every pass
        # timed shows is the switch between the two graphs, and the pass that pays it says which way
        base_wall = statistics.median(w for walls in by_position["detached"].values() for w in walls)
        result["sparse"]["period"] = args.sparse_period
        result["sparse"]["extra_us_by_position"] = {
            str(pos): rnd((statistics.median(walls) - base_wall) / 1e3, 1)
            for pos, walls in sorted(by_position["sparse"].items()) if len(walls) >= 3}
        result["sparse"]["extra_us_per_timed_pass"] = rnd(
            result["sparse"]["extra_us_per_pass"] * args.sparse_period, 1)
        result["sparse"]["budget_estimate_us_per_timed_pass"] = (
            rnd(statistics.median(estimates) * 1e6, 1) if estimates else None)
        result["sparse"]["wall_estimate_us_per_timed_pass"] = (
            rnd(statistics.median(wall_estimates) * 1e6, 1) if wall_estimates else None)
        result["records_per_timed_pass"] = getattr(marks, "records", None)
        result["sampled_passes"], result["passes"] = inst.sampled_passes, inst.passes
        result["dropped"] = {k: v for k, v in timer.dropped.items() if v}
        if DEVICE == "cuda":
            # where a marker keeps Inductor from fusing across a region boundary, the timed graph
            # launches more kernels than the untimed one (each a launch on a launch-bound pass)
            result["kernels_per_pass"] = {v: kernels_per_pass(segment, v) for v in variants[:3]}
        if args.profile_segments:
            # the Python functions each variant runs (cProfile: what the disarmed timed graph adds
            # over detached, where the thread's CPU alone cannot say)
            result["profiles"] = {v: profile_segments(segment, v, args.profile_segments, steps)
                                  for v in ("detached", "disarmed")}
    inst.remove()
    timer.close()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def pass_walls(fn: Callable[[], object], inst: object, passes: int, walls: dict[int, list[int]],
               detached: bool) -> float:
    """Run ``passes`` passes, each timed on the wall clock and filed in ``walls`` under its place
    after the last sampled pass (0: a sampled pass; none before the segment's first; all under 0
    when ``detached``); the rate."""
    clock = time.perf_counter_ns
    since = None
    sync()
    start = clock()
    for _ in range(passes):
        sampled = inst.sampled_passes
        t0 = clock()
        fn()
        ns = clock() - t0
        since = 0 if inst.sampled_passes != sampled else (None if since is None else since + 1)
        if detached or since is not None:
            walls.setdefault(since or 0, []).append(ns)
    sync()
    return passes / ((clock() - start) * 1e-9)


def kernels_per_pass(segment: Callable[..., object], variant: str, passes: int = 4) -> float | None:
    """GPU kernels a pass of ``segment(variant)`` launches (CUPTI's records via torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        segment(variant, passes)
    count = kernel_count(prof)
    return None if count is None else rnd(count / passes, 1)


def profile_segments(segment: Callable[[str], object], variant: str, segments: int, steps: int) -> dict:
    """cProfile over ``segments`` runs of ``segment(variant)`` (``steps`` passes each): the functions
    with the most time of their own, and the calls a pass makes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(segments):
        segment(variant)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, …)
    passes = segments * steps
    top = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:15]
    return {"passes": passes, "calls_per_pass": rnd(sum(c for c, *_ in stats.values()) / passes, 1),
            "top_tottime": [{"function": f"{path}:{line}({name})", "calls_per_pass": rnd(calls / passes, 2),
                             "tottime_us_per_pass": rnd(tottime * 1e6 / passes, 2)}
                            for (path, line, name), (calls, _, tottime, *_) in top]}


def run_attribution(name: str, args: argparse.Namespace) -> dict:
    """Under CUDA graph trees with the kernel busy window on: each region's kernel time attributed
    from CUPTI's records of one traced replay (``gpuscope_region_kernel_seconds``) against its
    event-node time and against all the kernel time of that replay."""
    model, call_args, call_kwargs, include = build(name)
    timer = Timer(CollectorRegistry(), sample_rate=1.0, calibrate_every=0)
    result: dict = {"workload": name, "mode": "reduce-overhead", "kind": "attribution"}
    with torch.no_grad():
        busy = timer.enable_kernel_busy(min_interval_s=0.0, budget_share=1.0)
        if busy.labels is None:
            return {**result, "error": "CUPTI's graph-node callbacks could not be subscribed"}
        seen: dict = {}
        kernel_ns = busy.labels.kernel_ns

        def counting(kernels, group_of):  # every record of the traced replays, labelled or not
            kernels = list(kernels)
            seen["all_ns"] = seen.get("all_ns", 0) + sum(max(0, ns) for _, ns in kernels)
            seen["records"] = seen.get("records", 0) + len(kernels)
            out = kernel_ns(kernels, group_of)
            seen["replays"] = seen.get("replays", 0) + out[1]
            return out

        busy.labels.kernel_ns = counting
        compiled = torch.compile(model, mode="reduce-overhead")
        inst = timer.instrument(compiled, include=include)

        def passes(n: int) -> None:
            for _ in range(n):
                compiled(*call_args, **call_kwargs)
                sync()
                timer.flush(30)
                busy.expire()

        def sums() -> dict[str, tuple[float, int]]:
            return {op: (sum(h.sum for h in timer.core.op_state(op).hists.values()),
                         sum(h.count for h in timer.core.op_state(op).hists.values())) for op in inst.ops}

        passes(8)  # compile, warm up, capture (the first passes' regions are not replays)
        before = sums()
        passes(args.accuracy_passes)
        after = sums()
        merged_names = {n for g in inst.compiled.merged() for n in g}
        regions = []
        for op in inst.ops:
            kernel_s = busy.kernel_seconds.get((op, "0"))
            seconds, count = (a - b for a, b in zip(after[op], before.get(op, (0.0, 0)), strict=True))
            if kernel_s is None or not count:
                continue
            regions.append({"op": op, "merged": op in merged_names or "+" in op,
                            "region_ms": rnd(seconds / count * 1e3, 4), "kernel_ms": rnd(kernel_s * 1e3, 4)})
        apart = [r for r in regions if not r["merged"]]
        attributed = sum(r["kernel_ms"] for r in apart)
        replays = seen.get("replays", 0)
        result.update({
            "windows": dict(busy.windows), "labelled_nodes": len(busy.labels.labels),
            "callback_errors": busy.labels.callback_errors, "traced_replays": replays,
            "regions": regions,
            "apart_kernel_ms": rnd(attributed, 4),
            "apart_region_ms": rnd(sum(r["region_ms"] for r in apart), 4),
            "replay_kernel_ms": rnd(seen["all_ns"] / replays * 1e-6, 4) if replays else None,
            "regions_over_attributed": rnd(sum(r["region_ms"] for r in apart) / attributed, 4)
            if attributed else None})
    inst.remove()
    timer.close()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def region_sums(timer: Timer, names: set[str]) -> tuple[float, int]:
    s = n = 0
    for op in timer.core.ops():
        if op.name in names:
            for h in op.hists.values():
                s += h.sum
                n += h.count
    return s, n


def run_one(name: str, mode: str, args: argparse.Namespace) -> dict:
    if mode == "eager":
        return run_eager(name, args)
    if mode == "attribution":
        return run_attribution(name, args)
    if mode == "parts":
        return run_parts(name, args)
    model, call_args, call_kwargs, include = build(name)
    twin_model = copy.deepcopy(model)
    compile_mode = None if mode == "default" else mode
    result: dict = {"workload": name, "mode": mode}
    registry = CollectorRegistry()
    timer = Timer(registry, calibrate_every=0)  # default budget (1%)
    with torch.no_grad():
        expected = model(*call_args, **call_kwargs)
        counters.clear()
        twin = torch.compile(twin_model, mode=compile_mode)
        t0 = time.perf_counter()
        for _ in range(3):
            twin(*call_args, **call_kwargs)
        sync()
        result["twin_compile_s"] = rnd(time.perf_counter() - t0, 1)
        result["twin_graph_breaks"] = sum(counters["graph_break"].values())  # the model's own
        counters.clear()
        compiled = torch.compile(model, mode=compile_mode)
        inst = timer.instrument(compiled, include=include)
        t0 = time.perf_counter()
        outputs_close = True
        for _ in range(8):  # compiles the untimed graph and its timed twin, captures both
            out = compiled(*call_args, **call_kwargs)
            ref, want = main_tensor(out), main_tensor(expected)
            close = torch.allclose(ref.float(), want.float(), atol=0.1, rtol=0.1)
            outputs_close = outputs_close and bool(close)
        sync()
        result["instrumented_compile_s"] = rnd(time.perf_counter() - t0, 1)
        result["outputs_close_to_eager"] = outputs_close

        def run_twin() -> None:
            twin(*call_args, **call_kwargs)

        def run_inst() -> None:
            compiled(*call_args, **call_kwargs)

        per_step = 1 / max(1e-3, rate(run_twin, 5))
        steps = max(5, int(args.segment_s / per_step))
        result["steps_per_segment"] = steps
        warm_until = time.perf_counter() + args.settle_s  # the budget controller adapts once a second
        while time.perf_counter() < warm_until:
            rate(run_inst, steps)
        result["budget"] = paired(run_twin, run_inst, steps, args.rounds)
        result["budget_same_model"] = paired(run_inst, run_inst, steps, args.rounds, inst=inst)
        if args.fine_s:
            result["budget_fine"] = fine_same_model(run_inst, inst, args.fine_s, steps)
        result["budget"]["period"] = timer.sampling_period()
        result["budget"]["overhead_ratio_estimate"] = rnd(timer.budget_controller.overhead_ratio, 5)
        result["budget"]["timed_passes"] = inst.sampled_passes
        result["budget"]["passes"] = inst.passes
        result["budget"].update(cost_estimates(inst, result["budget"]))
        # every pass sampled (the CUDA graph's timed twin still runs only once read: graph_busy)
        timer.core.fixed_rate = True
        timer.core.set_period(1)
        busy0, sampled0, passes0 = timer.dropped["graph_busy"], inst.sampled_passes, inst.passes
        rate(run_inst, steps)
        result["full"] = paired(run_twin, run_inst, steps, args.rounds)
        result["full_same_model"] = paired(run_inst, run_inst, steps, args.rounds, inst=inst)
        if args.fine_s:
            result["full_fine"] = fine_same_model(run_inst, inst, args.fine_s, steps)
        result["full"]["extra_us_per_pass"] = extra_us(result["full_same_model"])
        result["full"]["graph_busy"] = timer.dropped["graph_busy"] - busy0
        result["full"]["sampled_passes"] = inst.sampled_passes - sampled0
        result["full"]["passes"] = inst.passes - passes0
        # regions vs CUPTI over the same passes: each pass timed and read before the next
        timer.flush(10)
        merged = inst.compiled.merged()
        merged_names = {n for g in merged for n in g}
        apart = {n for n in inst.ops if "+" not in n and n not in merged_names}
        s0, n0 = region_sums(timer, set(inst.ops))
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(args.accuracy_passes):
                run_inst()
                sync()
                timer.flush(10)
        s1, n1 = region_sums(timer, set(inst.ops))
        kernels, span = kernel_seconds(prof)
        timed_count = kernel_count(prof)
        # the same passes untimed (timer detached): what the timed graph adds on the GPU, in kernels
        # (region boundaries Inductor could not fuse across) and in kernel time
        inst.detach()
        try:
            with profile(activities=[activity]) as prof:
                for _ in range(args.accuracy_passes):
                    run_inst()
                    sync()
        finally:
            inst.attach()
        untimed_kernels, _ = kernel_seconds(prof)
        untimed_count = kernel_count(prof)
        passes = args.accuracy_passes
        result["timed_graph_gpu"] = {
            "kernels_per_pass_timed": rnd(timed_count / passes, 1) if timed_count is not None else None,
            "kernels_per_pass_untimed": rnd(untimed_count / passes, 1) if untimed_count is not None else None,
            "kernel_ms_per_pass_timed": rnd(kernels * 1e3 / passes, 4),
            "kernel_ms_per_pass_untimed": rnd(untimed_kernels * 1e3 / passes, 4),
            "kernel_time_ratio": rnd(kernels / untimed_kernels, 4) if untimed_kernels else None}
        result["accuracy"] = {
            "passes": args.accuracy_passes, "samples": n1 - n0, "region_sum_ms": rnd((s1 - s0) * 1e3, 4),
            "cupti_kernel_sum_ms": rnd(kernels * 1e3, 4),
            "cupti_pass_span_ms": rnd(span * 1e3, 4) if span is not None else None,
            "regions_over_cupti": rnd((s1 - s0) / kernels, 4) if kernels else None,
            "regions_over_cupti_span": rnd((s1 - s0) / span, 4) if span else None,
            "regions_apart": len(apart), "regions": len(inst.compiled.names)}
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["graph_break_reasons"] = list(counters["graph_break"])[:5]
        result["unique_graphs"] = counters["stats"]["unique_graphs"]
        result["merged"] = merged
        result["graphs_checked"] = inst.compiled.graphs_checked
        result["dropped"] = {k: v for k, v in timer.dropped.items() if v}
        result["stray_marks"] = inst.compiled.stray_marks
        # the markers' path: one C call from the emitted code (RegionMarks, called directly) or not
        # events per timed pass: recorded by the markers of the last one run from Python (default
        # compile), event nodes in each captured timed graph (reduce-overhead); 2 per region where
        # no two markers share one
        shapes = getattr(inst.compiled, "_shapes", {}).values()
        result["markers"] = {"kind": type(inst.compiled.marks).__name__,
                             "called_directly": fusion.calls_directly(),
                             "marker_calls_per_timed_pass": 2 * len(inst.compiled.names),
                             "records_per_timed_pass": getattr(inst.compiled.marks, "records", None),
                             "graph_event_nodes": sorted(getattr(g, "nodes", len(g.events)) for g in shapes
                                                         if g.events)}
        result["fusion_analysis_failures"] = fusion.analysis_failures[0]
        records = result["markers"]["records_per_timed_pass"]
        if records and result["full"]["extra_us_per_pass"] is not None:
            result["full"]["extra_us_per_record"] = rnd(result["full"]["extra_us_per_pass"] / records, 2)
    inst.remove()
    timer.close()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def table(results: list[dict]) -> str:
    rows = ["| workload | mode | untimed steps/s | default budget loss (q1–q3) | same model | fine blocks "
            "| period | estimate: thread CPU / wall / step / charged "
            "| full loss (q1–q3) | same model | fine blocks "
            "| breaks | merged "
            "| regions / CUPTI kernel sum | regions / CUPTI pass span |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def kind(r: dict) -> str:  # attribution runs under reduce-overhead: its own table all the same
        return r.get("kind", r["mode"])

    for r in results:
        if kind(r) in ("eager", "attribution", "parts") and "error" not in r:
            continue  # their own tables below
        if "error" in r:
            rows.append(f"| {r['workload']} | {r['mode']} | error: {r['error'][:60]} ||||||||||||")
            continue
        b, f, a = r["budget"], r["full"], r["accuracy"]

        def pct(x: dict) -> str:
            return f"{100 * x['median']:.2f}% ({100 * x['q1']:.2f}–{100 * x['q3']:.2f})" if "q1" in x else "?"

        same_b, same_f = r["budget_same_model"]["loss"], r["full_same_model"]["loss"]

        def implied(budget: dict) -> str:  # the loss the running means imply, by each clock
            got = [budget.get(f"implied_loss_{k}") for k in ("thread", "wall", "step", "charged")]
            return " / ".join("—" if v is None else f"{100 * v:.2f}%" for v in got)

        def fine(result: dict, key: str) -> str:  # the summed-time loss of the short alternating blocks
            return f"{100 * result[key]['loss_total']:.2f}%" if key in result else "—"

        rows.append(f"| {r['workload']} | {r['mode']} | {b['untimed_steps_per_s']} | {pct(b['loss'])} | "
                    f"{pct(same_b)} | {fine(r, 'budget_fine')} | {b['period']} | {implied(b)} | "
                    f"{pct(f['loss'])} | "
                    f"{pct(same_f)} | {fine(r, 'full_fine')} | "
                    f"{r['graph_breaks']} | {len(r['merged'])} | "
                    f"{a['regions_over_cupti']} | {a.get('regions_over_cupti_span')} |")
    rows += ["", "| workload | eager: default budget (same model) | every pass sampled | µs a pass "
             "| µs a region |", "|---|---|---|---|---|"]
    for r in results:
        if kind(r) == "eager" and "error" not in r:
            f = r["full_same_model"]
            rows.append(f"| {r['workload']} | {100 * r['budget_same_model']['loss']['median']:.2f}% | "
                        f"{100 * f['loss']['median']:.2f}% | {f['extra_us_per_pass']} | "
                        f"{f.get('extra_us_per_region')} |")
    rows += ["", "| workload | traced replays | attributed kernel ms (regions apart) | their event ms "
             "| all kernel ms of a replay | events / attributed |", "|---|---|---|---|---|---|"]
    for r in results:
        if kind(r) == "attribution" and "error" not in r:
            rows.append(f"| {r['workload']} | {r['traced_replays']} | {r['apart_kernel_ms']} | "
                        f"{r['apart_region_ms']} | {r['replay_kernel_ms']} | "
                        f"{r['regions_over_attributed']} |")
    rows += ["", "| workload | recycler | every pass timed: µs a pass (thread CPU) "
             "| markers disarmed: µs a pass (thread CPU) | records a pass | sparse: µs a timed pass "
             "(budget's estimate; on the wall clock) | sparse: µs by place after the timed pass |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if kind(r) == "parts" and "error" not in r:
            t, d, sp = r["timed"], r["disarmed"], r["sparse"]
            rows.append(f"| {r['workload']} | {r['recycler']} | {t['extra_us_per_pass']} "
                        f"({t['extra_thread_cpu_us']}) | {d['extra_us_per_pass']} "
                        f"({d['extra_thread_cpu_us']}) | {r['records_per_timed_pass']} | "
                        f"{sp['extra_us_per_timed_pass']} ({sp['budget_estimate_us_per_timed_pass']}; "
                        f"{sp.get('wall_estimate_us_per_timed_pass')}) | "
                        f"{' '.join(str(v) for v in sp['extra_us_by_position'].values())} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="encoder,llama-decode,llama-prefill,resnet50")
    parser.add_argument("--modes", default="reduce-overhead,default")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--segment-s", type=float, default=0.2)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--accuracy-passes", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=1e9, help="skip what would start after this")
    parser.add_argument("--profile-segments", type=int, default=0,
                        help="parts mode: also cProfile this many segments of detached and of disarmed")
    parser.add_argument("--fine-s", type=float, default=3.0,
                        help="seconds of short alternating blocks against the same model detached, "
                             "at the budget and with every pass timed (0: none)")
    parser.add_argument("--sparse-period", type=int, default=9,
                        help="parts mode: the period of its sparse variant (every Nth pass timed)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    start = time.perf_counter()
    doc = {"date": dt.date.today().isoformat(),
           "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
           "torch": torch.__version__, "args": vars(args), "results": []}
    for name in args.workloads.split(","):
        for mode in args.modes.split(","):
            if time.perf_counter() - start > args.deadline_s:
                doc["results"].append({"workload": name, "mode": mode, "error": "skipped: out of time"})
                continue
            log(f"{name} / {mode}")
            try:
                doc["results"].append(run_one(name, mode, args))
            except Exception as exc:
                traceback.print_exc()
                doc["results"].append({"workload": name, "mode": mode, "error": repr(exc)[:400]})
            log(json.dumps(doc["results"][-1])[:600])
            write_json(args.out, doc, indent=1)
            torch._dynamo.reset()
    print(table(doc["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
