#!/usr/bin/env python3
"""Regions inside CUDA graphs: accuracy against eager timing of the same step, and the cost.

The step: a decode-like model (``--layers`` blocks of {attention-like matmul, MLP}, batch 8,
d 1024, bf16; 2 regions per block, timed with ``instrument()``), captured with
``Timer.graph`` (gpuscope.timing.graphs.TimedGraph). Three measurements, on one GPU:

1. per-module GPU time from sampled graph replays queued back to back (as a serving loop runs
   them) vs the same modules timed eagerly with the stream pre-filled (a long sleep kernel queued
   ahead, so the GPU never waits for the CPU's launches and eager regions measure GPU work only);
   target: within 5%. Both are also reported with an idle queue (each graph replay or eager pass
   waits for the last): eager regions then read launch waits, and a graph replay that starts on
   an idle GPU reads its first nodes' start-up;
2. replay throughput with graph timing at its budgeted period vs a plain ``torch.cuda.CUDAGraph``
   of the same step, in interleaved paired rounds (median of paired ratios, quartiles);
   target ≤ 1% loss;
3. what a timed replay costs: GPU time of a timed vs an untimed replay, the period chosen from
   it, and the graph baseline (an empty pair of event nodes);
4. CUPTI's view of the same modules (``kernels``, through torch.profiler): one block's attention
   and MLP run eagerly and replayed from a graph of that module alone, each behind a pre-filled
   queue: the sum of their kernels' durations and the span from the first kernel's start to the
   last one's end. Where graph and eager region times differ, this says whether the kernels or
   the gaps between them did.

Also checks that replay outputs equal eager outputs. Writes ``--out`` (JSON; default the current
H200 result, ``benchmarks/results/graph-timing-h200-2026-12-02-after-data-model.json``), progress
on stderr, a table last; exit 1 (the failing part named) if a part fails.

    python benchmarks/graph_timing_bench.py --out /tmp/graph-timing.json   # ~2 min
    python benchmarks/graph_timing_bench.py --parts accuracy,kernels --out /tmp/graph-kernels.json

The committed H200 results and the commands that made them are listed in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The file benchmarks/README.md lists as this script's current result: a run without ``--out``
#: replaces it.
CURRENT_RESULT = "graph-timing-h200-2026-12-02-after-data-model.json"
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from benchlib import logger, utc_now, write_json  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from gpuscope.timing import Timer  # noqa: E402

log = logger("graph_timing_bench")


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(d, d, bias=False)  # attention-like: one d×d matmul per token
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Model(torch.nn.Module):
    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def per_op_means(registry: CollectorRegistry, before: dict[str, tuple[float, float]] | None = None
                 ) -> dict[str, tuple[float, float]]:
    """op → (count, sum) from the registry (minus ``before``)."""
    out: dict[str, tuple[float, float]] = {}
    for family in registry.collect():
        if family.name != "gpuscope_region_gpu_seconds":
            continue
        counts = {s.labels["op"]: s.value for s in family.samples if s.name.endswith("_count")}
        sums = {s.labels["op"]: s.value for s in family.samples if s.name.endswith("_sum")}
        for op, n in counts.items():
            b = (before or {}).get(op, (0.0, 0.0))
            out[op] = (n - b[0], sums[op] - b[1])
    return out


def mean_us(delta: dict[str, tuple[float, float]], kind: str) -> float:
    """Mean µs per region over every op whose name ends with ``kind`` (attn or mlp)."""
    n = sum(c for op, (c, _) in delta.items() if op.endswith(kind))
    s = sum(v for op, (_, v) in delta.items() if op.endswith(kind))
    return 1e6 * s / n if n else float("nan")


def accuracy(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = Model(args.layers, args.dim).cuda().to(torch.bfloat16).eval()
    x = torch.randn(args.batch, args.dim, device="cuda", dtype=torch.bfloat16)
    registry = CollectorRegistry()
    timer = Timer(registry, sample_rate=1.0, calibrate_every=0)
    inst = timer.instrument(model, include=("attn", "mlp"))
    try:
        with torch.no_grad():
            expected = model(x)
            for _ in range(3):
                model(x)
            timer.flush(10)
            # eager, idle queue: each launch waits for the CPU
            before = per_op_means(registry)
            for _ in range(args.eager_passes):
                model(x)
                torch.cuda.synchronize()
            timer.flush(10)
            eager_idle = per_op_means(registry, before)
            # eager, pre-filled queue: the GPU never waits for a launch
            before = per_op_means(registry)
            for _ in range(args.eager_passes):
                torch.cuda._sleep(int(args.prefill_cycles))
                model(x)
                torch.cuda.synchronize()
            timer.flush(10)
            eager_full = per_op_means(registry, before)
            graph = timer.graph(lambda: model(x), period=1, copies=4, warm_up=2)
            # idle queue: every replay waits for the previous one (and starts on an idle GPU)
            before = per_op_means(registry)
            outputs_equal = True
            for _ in range(args.graph_replays):
                out = graph.replay()
                torch.cuda.synchronize()
                outputs_equal = outputs_equal and torch.equal(out, expected)
                timer.flush(10)
            graph_idle = per_op_means(registry, before)
            # queued: replays back to back, as a serving loop runs them; copies rotate and busy ones
            # are skipped (graph_busy), and each sample still comes from a single replay
            before = per_op_means(registry)
            busy0 = timer.dropped["graph_busy"]
            for _ in range(args.queued_replays):
                graph.replay()
            torch.cuda.synchronize()
            timer.flush(10)
            queued = per_op_means(registry, before)
    finally:
        inst.remove()
        timer.close()
    result = {"regions_per_replay": graph.regions, "outputs_equal_eager": outputs_equal,
              "graph_baseline_us": None if graph.baseline_s is None else graph.baseline_s * 1e6,
              "eager_baseline_us": timer.resolver.baseline_s.get(0, 0.0) * 1e6}
    for kind in ("attn", "mlp"):
        g, full = mean_us(queued, kind), mean_us(eager_full, kind)
        result[kind] = {"graph_queued_us": round(g, 3), "eager_prefilled_us": round(full, 3),
                        "graph_idle_queue_us": round(mean_us(graph_idle, kind), 3),
                        "eager_idle_queue_us": round(mean_us(eager_idle, kind), 3),
                        "graph_queued_over_eager_prefilled": round(g / full, 4)}
    result["queued_timed_replays"] = sum(c for c, _ in queued.values()) / max(1, graph.regions)
    result["queued_graph_busy_drops"] = timer.dropped["graph_busy"] - busy0
    result["within_5pct"] = all(abs(result[k]["graph_queued_over_eager_prefilled"] - 1) <= 0.05
                                for k in ("attn", "mlp"))
    return result


def throughput(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = Model(args.layers, args.dim).cuda().to(torch.bfloat16).eval()
    x = torch.randn(args.batch, args.dim, device="cuda", dtype=torch.bfloat16)
    registry = CollectorRegistry()
    timer = Timer(registry, calibrate_every=0)  # budget mode: the graph's period comes from its cost
    inst = timer.instrument(model, include=("attn", "mlp"))
    with torch.no_grad():
        timed = timer.graph(lambda: model(x), copies=2, warm_up=2)
        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain):  # regions in a capture that no TimedGraph owns are left out
            model(x)

        def rate(run) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.replays_per_round):
                run()
            torch.cuda.synchronize()
            return args.replays_per_round / (time.perf_counter() - t0)

        for _ in range(2):
            rate(timed.replay), rate(plain.replay)
        ratios, on, off = [], [], []
        for i in range(args.rounds):
            pair = [("on", timed.replay), ("off", plain.replay)]
            if i % 2:
                pair.reverse()
            got = {name: rate(run) for name, run in pair}
            on.append(got["on"])
            off.append(got["off"])
            ratios.append(got["on"] / got["off"])
            timer.flush(10)
    inst.remove()
    quart = statistics.quantiles(ratios, n=4)
    result = {"period": timed.period, "timed_replay_cost_ratio": timed.cost_ratio,
              "timed_replays": timed.timed_replays, "replays": timed.replays,
              "budget": timer.core.budget, "rounds": args.rounds,
              "replays_per_round": args.replays_per_round,
              "replays_per_s_timing_on_median": round(statistics.median(on), 1),
              "replays_per_s_timing_off_median": round(statistics.median(off), 1),
              "on_over_off_median": round(statistics.median(ratios), 4),
              "on_over_off_quartiles": [round(q, 4) for q in (quart[0], quart[2])],
              "loss_pct": round(100 * (1 - statistics.median(ratios)), 2),
              "samples_from_replays": sum(c for c, _ in per_op_means(registry).values()),
              "dropped": dict(timer.dropped)}
    timer.close()
    result["within_1pct"] = result["loss_pct"] <= 1.0
    return result


def kernel_spans(run, passes: int, prefill_cycles: int) -> dict:
    """``run()`` ``passes`` times, each behind a sleep kernel, under torch.profiler (CUPTI): per pass,
    medians of the kernels' summed durations and of their span (first start to last end), in µs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            torch.cuda._sleep(prefill_cycles)
            run()
        torch.cuda.synchronize()
    return pass_spans([(e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and "spin" not in e.name.lower()],
                      passes)


def pass_spans(kernels: list[tuple[float, float]], passes: int) -> dict:
    """(start, end) of every kernel of ``passes`` equal passes run one after another: per pass,
    medians of the kernels' summed durations and of their span (first start to last end)."""
    kernels = sorted(kernels)
    per_pass, extra = divmod(len(kernels), passes)
    if per_pass == 0 or extra:
        raise RuntimeError(f"CUPTI reported {len(kernels)} kernels for {passes} passes")
    passes_kernels = [kernels[i * per_pass:(i + 1) * per_pass] for i in range(passes)]
    return {"kernels_per_pass": per_pass,
            "kernel_sum_us": round(statistics.median(sum(end - start for start, end in k)
                                                     for k in passes_kernels), 3),
            "span_us": round(statistics.median(k[-1][1] - k[0][0] for k in passes_kernels), 3)}


def kernels(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    block = Model(1, args.dim).cuda().to(torch.bfloat16).eval().blocks[0]
    x = torch.randn(args.batch, args.dim, device="cuda", dtype=torch.bfloat16)
    result = {}
    with torch.no_grad():
        for kind in ("attn", "mlp"):
            module = getattr(block, kind)
            for _ in range(3):
                module(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                module(x)
            graph.replay()
            eager = kernel_spans(lambda m=module: m(x), args.eager_passes, int(args.prefill_cycles))
            replayed = kernel_spans(graph.replay, args.eager_passes, int(args.prefill_cycles))
            result[kind] = {"eager_prefilled": eager, "graph": replayed,
                            "span_graph_minus_eager_us": round(replayed["span_us"] - eager["span_us"], 3),
                            "kernel_sum_graph_minus_eager_us": round(
                                replayed["kernel_sum_us"] - eager["kernel_sum_us"], 3)}
    return result


PARTS = {"accuracy": accuracy, "throughput": throughput, "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eager-passes", type=int, default=50)
    p.add_argument("--graph-replays", type=int, default=50)
    p.add_argument("--queued-replays", type=int, default=2000)
    p.add_argument("--prefill-cycles", type=float, default=2e7, help="sleep kernel cycles queued ahead")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--replays-per-round", type=int, default=2000)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results" / CURRENT_RESULT),
                   help="JSON path (default: the current H200 result, as benchmarks/README.md lists it)")
    args = p.parse_args(argv)
    parts = [name for name in args.parts.split(",") if name]
    if not parts or set(parts) - set(PARTS):
        p.error(f"--parts: choose from {', '.join(PARTS)} (got {args.parts!r})")
    if not torch.cuda.is_available():
        print("graph_timing_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": utc_now(),
              "step": f"{args.layers} blocks x (attn-like matmul, MLP), batch {args.batch}, "
                      f"d {args.dim}, bf16",
              "parts": {}}
    failures = []
    for name in parts:
        log(f"part {name}")
        try:
            report["parts"][name] = PARTS[name](args)
        except Exception as exc:
            report["parts"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc()}
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    report["failures"] = failures
    out = write_json(args.out, report, default=str)
    acc, thr = report["parts"].get("accuracy", {}), report["parts"].get("throughput", {})
    rows = [("GPU", report["gpu"]), ("step", report["step"])]
    for kind in ("attn", "mlp"):
        if kind in acc:
            a = acc[kind]
            rows.append((f"{kind} µs: graph, eager (queue full) | graph, eager (idle queue)",
                         f"{a['graph_queued_us']}, {a['eager_prefilled_us']} | {a['graph_idle_queue_us']}, "
                         f"{a['eager_idle_queue_us']}"))
    if "outputs_equal_eager" in acc:
        rows.append(("graph within 5% of eager, queue full", str(acc["within_5pct"])))
        rows.append(("outputs equal eager", str(acc["outputs_equal_eager"])))
    if "loss_pct" in thr:
        rows.append(("timed replay cost / period", f"{thr['timed_replay_cost_ratio']} / {thr['period']}"))
        rows.append(("replays/s on vs off (loss %)", f"{thr['replays_per_s_timing_on_median']} vs "
                     f"{thr['replays_per_s_timing_off_median']} ({thr['loss_pct']} %)"))
    for kind, k in report["parts"].get("kernels", {}).items():
        if isinstance(k, dict) and "graph" in k:
            rows.append((f"{kind} CUPTI µs: kernels, span: graph | eager (queue full)",
                         f"{k['graph']['kernel_sum_us']}, {k['graph']['span_us']} | "
                         f"{k['eager_prefilled']['kernel_sum_us']}, {k['eager_prefilled']['span_us']}"))
    rows += [("FAILED", f) for f in failures]
    rows.append(("written", str(out)))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
