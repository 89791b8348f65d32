"""Timing benchmark: hot-path cost, throughput loss on an eager transformer, accuracy against CUPTI.

Runs on the GPU (the numbers that count) or, with --quick on a CPU-only machine, as a smoke test.
Method (docs/design.md): every configuration is compared with the untimed model in interleaved paired
rounds (base, config, base, config, ...), reported as the median of the paired ratios with
quartiles, beside the main thread's CPU time per forward.

    python benchmarks/timing_bench.py --out benchmarks/results/timing-h200-c-hot-path.json   # H200, ~6 min
    python benchmarks/timing_bench.py --accuracy-only \
        --out benchmarks/results/timing-accuracy-h200-recycler.json
    python benchmarks/timing_bench.py --quick --out /tmp/timing-cpu.json  # smoke

Configurations (24 timed regions a forward: attention and MLP of 12 blocks):
    raw_records     two raw cudaEventRecord calls per region, nothing else: the floor
    gpuscope_default   Timer() + instrument(): 1% overhead budget, exact regions
    gpuscope_full   every region timed, exact mode (48 records a forward)
    gpuscope_full_partition   every region timed, shared boundaries (25 records a forward)
    ..._python      the same with the Python hot path (the fallback where the C extension is not built)
    naive_torch     forward hooks creating and recording torch.cuda.Event, a polling thread
    torch_profiler  torch.profiler with CPU and CUDA activities
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import torch
from benchlib import logger, today, write_json

from gpuscope.timing import Timer, hot
from gpuscope.timing.routes import CudartCtypesRoute


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


progress = logger(None, sys.stdout)  # [HH:MM:SS] lines, on stdout with the report


def quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else [float("nan")] * 2
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


# --- 1. idle microbenchmark -------------------------------------------------------------------

def idle_costs(cuda: bool, n: int, reps: int) -> dict:
    """µs per call on an idle thread: raw record, gpuscope region, naive torch event pair."""
    out: dict[str, float] = {}
    if cuda:
        stream = torch._C._cuda_getCurrentRawStream(0)
        route = CudartCtypesRoute()
        raw_events = [route.create() for _ in range(2)]
        record = route.record
        samples = []
        for _ in range(reps):
            t0 = time.thread_time_ns()
            for _ in range(n):
                record(raw_events[0], stream)
            samples.append((time.thread_time_ns() - t0) / n / 1e3)
            torch.cuda.synchronize()
        out["raw_record_us"] = statistics.median(samples)
        # torch.cuda.Event pair (preallocated, as a careful naive user would)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(reps):
            t0 = time.thread_time_ns()
            for _ in range(n):
                e0.record()
                e1.record()
            samples.append((time.thread_time_ns() - t0) / n / 1e3)
            torch.cuda.synchronize()
        out["naive_torch_us_per_region"] = statistics.median(samples)
    for suffix, native in (("", None), ("_python", False)):
        if native is None and not hot.native_available():
            continue
        timer = Timer(None, sample_rate=1.0, pool_size=2 * n + 64, ring_size=n + 16, resolve_interval=0.05,
                      native=native)
        region = timer.region("idle")
        samples, walls = [], []
        for _ in range(reps):
            timer.flush(30)
            # CPU time of this thread: the resolver's work, which takes the GIL meanwhile, is its own
            # thread's cost (reported in the throughput runs), not the hot path's.
            t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(n):
                with region:
                    pass
            samples.append((time.thread_time_ns() - t0) / n / 1e3)
            walls.append((time.perf_counter_ns() - w0) / n / 1e3)
            if cuda:
                torch.cuda.synchronize()
        out[f"hot_path_us_per_region{suffix}"] = statistics.median(samples)
        out[f"hot_path_wall_us_per_region_with_resolver{suffix}"] = statistics.median(walls)
        out[f"hot_path_dropped{suffix}"] = dict(timer.dropped)
        out["route"] = timer.route.name
        timer.close()
    return out


# --- 2. configurations on the transformer ----------------------------------------------------

class Config:
    """Installs and removes one way of timing the model's attention and MLP modules."""

    def __init__(self, name: str, mods: list[tuple[str, torch.nn.Module]], model: torch.nn.Module,
                 cuda: bool) -> None:
        self.name, self.mods, self.model, self.cuda = name, mods, model, cuda
        self.timer: Timer | None = None
        self.inst = None
        self.hooks: list = []
        self.prof = None
        self.stop_poll = threading.Event()
        self.poller: threading.Thread | None = None
        self.pending: collections.deque = collections.deque()
        native = False if name.endswith("_python") else None  # C where it is built
        # The C hot path hands plain pairs to its recycler thread unless the name asks for the
        # resolver's loops: in C (``_cresolve``) or in Python (``_pyresolve``).
        recycler = False if name.endswith(("_cresolve", "_pyresolve")) else None
        # ``_recycle<N>us``: the recycler thread polls every N µs instead of hot.RECYCLE_INTERVAL_S.
        interval = re.search(r"_recycle(\d+)us$", name)
        default_interval = hot.RECYCLE_INTERVAL_S
        if interval:
            hot.RECYCLE_INTERVAL_S = int(interval.group(1)) * 1e-6
        try:
            if name == "gpuscope_default":
                self.timer = Timer(None, native=native, recycler=recycler)
            elif name.startswith("gpuscope_full"):
                self.timer = Timer(None, sample_rate=1.0, native=native, recycler=recycler)
        finally:
            hot.RECYCLE_INTERVAL_S = default_interval
        if name.endswith("_pyresolve"):
            self.timer.resolver.fast = None
        if name in ("raw_records", "raw_shared") and cuda:
            self.route = CudartCtypesRoute()
            self.raw = {path: (self.route.create(), self.route.create()) for path, _ in mods}

    def install(self) -> None:
        name = self.name
        if name.startswith("gpuscope"):
            # One instrumentation for the whole run, detached between measurements, so the budget's
            # cost estimates and sampling state persist as they would in a long-running server.
            if self.inst is None:
                mode = "partition" if "partition" in name else "exact"
                self.inst = self.timer.instrument(self.model, include=("attn", "mlp"), mode=mode)
            else:
                self.inst.attach()
        elif name == "raw_records":
            for path, module in self.mods:
                module.forward = self._raw_forward(module.forward, *self.raw[path]) if self.cuda else \
                    self._host_forward(module.forward)
        elif name == "raw_shared" and self.cuda:  # the floor of shared boundaries: one record a region
            for path, module in self.mods:
                module.forward = self._raw_start_forward(module.forward, self.raw[path][0])
        elif name == "naive_torch":
            for _, module in self.mods:
                self.hooks += [module.register_forward_pre_hook(self._pre),
                               module.register_forward_hook(self._post)]
            self.stop_poll.clear()
            self.poller = threading.Thread(target=self._poll, daemon=True)
            self.poller.start()
        elif name == "torch_profiler":
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def uninstall(self) -> None:
        if self.inst is not None:
            self.inst.detach()
        for _, module in self.mods:
            module.__dict__.pop("forward", None)
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        if self.poller is not None:
            self.stop_poll.set()
            self.poller.join()
            self.poller = None
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None

    def _raw_forward(self, original, e0, e1):
        record, stream_of = self.route.record, torch._C._cuda_getCurrentRawStream

        def forward(*args, **kwargs):
            record(e0, stream_of(0))
            try:
                return original(*args, **kwargs)
            finally:
                record(e1, stream_of(0))

        return forward

    def _raw_start_forward(self, original, event):
        record, stream_of = self.route.record, torch._C._cuda_getCurrentRawStream

        def forward(*args, **kwargs):
            record(event, stream_of(0))
            return original(*args, **kwargs)

        return forward

    @staticmethod
    def _host_forward(original):
        def forward(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                t0 = time.perf_counter_ns() - t0

        return forward

    def _pre(self, module, inputs):
        if self.cuda:
            module._naive_start = torch.cuda.Event(enable_timing=True)
            module._naive_start.record()
        else:
            module._naive_start = time.perf_counter()

    def _post(self, module, inputs, output):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((module._naive_start, end))
        else:
            self.pending.append((module._naive_start, time.perf_counter()))

    def _poll(self):
        while not self.stop_poll.wait(0.005):
            while self.pending:
                start, end = self.pending[0]
                if self.cuda:
                    if not end.query():
                        break
                    start.elapsed_time(end)
                self.pending.popleft()

    def close(self) -> None:
        self.uninstall()
        if self.inst is not None:
            self.inst.remove()
        if self.timer is not None:
            self.timer.close()


def throughput(cuda: bool, label: str, bs: int, seq: int, iters: int, rounds: int, configs: list[str],
               d: int, layers: int, heads: int, warm_s: float) -> dict:
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(d, heads) for _ in range(layers)]).to(dev, dtype).eval()
    x = torch.randn(bs, seq, d, device=dev, dtype=dtype)
    mods = [(f"{i}.{n}", getattr(b, n)) for i, b in enumerate(model) for n in ("attn", "mlp")]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    cfgs = {name: Config(name, mods, model, cuda) for name in configs}

    sampled_fraction: dict[str, list[float]] = collections.defaultdict(list)

    def measure(cfg: Config | None) -> tuple[float, float]:
        if cfg is not None:
            cfg.install()
        inst = cfg.inst if cfg is not None else None
        before = (inst.passes, inst.sampled_passes) if inst is not None else None
        try:
            with torch.no_grad():
                for _ in range(5):
                    model(x)
                sync()
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(iters):
                    model(x)
                c1 = time.thread_time()
                sync()
                t1 = time.perf_counter()
        finally:
            if cfg is not None:
                cfg.uninstall()
        if inst is not None:
            passes, sampled = inst.passes - before[0], inst.sampled_passes - before[1]
            sampled_fraction[cfg.name].append(sampled / passes if passes else 0.0)
        return iters / (t1 - t0), (c1 - c0) / iters * 1e6

    with torch.no_grad():
        for _ in range(30):
            model(x)
    sync()
    if "gpuscope_default" in cfgs:  # let the budget controller converge before measuring
        cfg = cfgs["gpuscope_default"]
        cfg.install()
        deadline = time.monotonic() + warm_s
        with torch.no_grad():
            while time.monotonic() < deadline:
                model(x)
        sync()
        cfg.uninstall()
    ratios, cpu_added, base_its = collections.defaultdict(list), collections.defaultdict(list), []
    for rnd in range(rounds):
        order = list(configs)
        random.Random(rnd).shuffle(order)
        for name in order:
            b_its, b_cpu = measure(None)
            v_its, v_cpu = measure(cfgs[name])
            base_its.append(b_its)
            ratios[name].append(v_its / b_its)
            cpu_added[name].append(v_cpu - b_cpu)
        progress(f"{label}: round {rnd + 1}/{rounds} done")
    result = {"base_it_s_median": statistics.median(base_its), "configs": {}}
    for name in configs:
        r = ratios[name]
        entry = {
            "loss_pct_median": 100 * (1 - statistics.median(r)),
            "loss_pct_q1_q3": [100 * (1 - q) for q in reversed(quartiles(r))],
            "main_thread_cpu_us_added_per_forward": statistics.median(cpu_added[name]),
            "cpu_us_added_per_region": statistics.median(cpu_added[name]) / len(mods),
        }
        timer = cfgs[name].timer
        if timer is not None:
            timer.flush(10)
            entry["sampling_ratio_final"] = 1 / timer.sampling_period()
            entry["sampled_pass_fraction_median"] = statistics.median(sampled_fraction[name])
            cost = cfgs[name].inst.cost.per_sampled_pass_s()
            entry["measured_cost_us_per_sampled_pass"] = None if cost is None else cost * 1e6
            entry["overhead_ratio_estimate"] = timer.budget_controller.overhead_ratio
            entry["hot_path_us_in_context"] = timer.core.hot_path_s * 1e6
            entry["dropped"] = dict(timer.dropped)
            entry["samples"] = sum(h.count for op in timer.core.ops() for h in op.hists.values())
        result["configs"][name] = entry
    for cfg in cfgs.values():
        cfg.close()
    return result


# --- 3. accuracy against CUPTI ----------------------------------------------------------------

def kernel_time_per_iteration_us(prof, iterations: int) -> float:
    """CUPTI's GPU time of every kernel but the spin (sleep) kernels, per iteration: one matmul
    may run as more than one kernel."""
    total = sum(e.time_range.elapsed_us() for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and "spin" not in e.name.lower())
    return total / iterations


def accuracy(n_ms: int, n_short: int) -> dict:
    timer = Timer(None, sample_rate=1.0, calibrate_every=0)
    torch_timer = Timer(None, backend="torch", sample_rate=1.0, calibrate_every=0)
    acts = [torch.profiler.ProfilerActivity.CUDA]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    # Each timer's first region makes its event pool (4096 events): a torch-route pool made inside
    # our first measured region would add tens of ms of idle GPU to it.
    for t in (timer, torch_timer):
        t.stop(t.start("warm-up", on_elapsed=lambda s: None))
    torch.cuda.synchronize()
    got, got_torch = [], []
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n_ms):
            h = timer.start("matmul", on_elapsed=got.append)
            h2 = torch_timer.start("matmul", on_elapsed=got_torch.append)
            torch.matmul(a, b, out=c)
            torch_timer.stop(h2)
            timer.stop(h)
        torch.cuda.synchronize()
    timer.flush(30)
    torch_timer.flush(30)
    # Medians: one region that waited on something else (a pool being made, the profiler starting)
    # would move a mean of 30 by percents.
    ms_events = statistics.median(got) * 1e6
    ms_torch_events = statistics.median(got_torch) * 1e6
    ms_cupti = kernel_time_per_iteration_us(prof, n_ms)
    # µs-scale regions behind a busy queue: one small elementwise kernel each.
    x = torch.zeros(1 << 16, device="cuda")
    short = []
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n_short):
            torch.cuda._sleep(1_000_000)  # ~0.5 ms: the region's records are queued, not CPU-paced
            h = timer.start("short", on_elapsed=short.append)
            x.add_(1)
            timer.stop(h)
        torch.cuda.synchronize()
    timer.flush(30)
    short_cupti = kernel_time_per_iteration_us(prof, n_short)
    result = {
        "ms_kernel_events_us": ms_events,
        "ms_kernel_torch_route_us": ms_torch_events,
        "ms_kernel_cupti_us": ms_cupti,
        "accuracy_pct_ms_kernel": 100 * (ms_events - ms_cupti) / ms_cupti,
        "route_agreement_pct": 100 * (ms_events - ms_torch_events) / ms_torch_events,
        "short_region_events_us": statistics.median(short) * 1e6,
        "short_region_cupti_us": short_cupti,
        "accuracy_us_short_region": statistics.median(short) * 1e6 - short_cupti,
        "ms_kernel_events_us_mean": statistics.mean(got) * 1e6,
        "baseline_us": timer.resolver.baseline_s.get(0, 0.0) * 1e6,
        "n_ms": len(got), "n_short": len(short),
    }
    timer.close()
    torch_timer.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="timing-h200.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--accuracy-only", action="store_true", help="only the comparison with CUPTI")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    quick = args.quick
    configs = ["raw_records", "gpuscope_default", "gpuscope_full", "gpuscope_full_partition",
               "gpuscope_full_python", "gpuscope_full_partition_python", "naive_torch", "torch_profiler"]
    if not hot.native_available():
        print("the C hot path is not built: the gpuscope_* rows without _python use Python too", flush=True)
    out: dict = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU)",
        "hot_path": "C" if hot.native_available() else "Python (C extension not built)",
        "date": today(),
        "torch": torch.__version__,
        "method": "medians of interleaved paired rounds (base, config) with quartiles; docs/design.md",
    }
    if args.accuracy_only:
        if not cuda:
            print("--accuracy-only needs a CUDA GPU", file=sys.stderr)
            return 2
        out["accuracy"] = accuracy(30, 300)
        write_json(args.out, out, indent=1, default=float)
        print(json.dumps(out["accuracy"], indent=1))
        return 0
    progress("idle microbenchmark")
    out["idle"] = idle_costs(cuda, n=2000 if quick else 20000, reps=3 if quick else 5)
    out["raw_record_us"] = out["idle"].get("raw_record_us")
    out["hot_path_us_per_region"] = out["idle"].get("hot_path_us_per_region")
    out["hot_path_us_per_region_python"] = out["idle"]["hot_path_us_per_region_python"]
    out["naive_torch_us_per_region"] = out["idle"].get("naive_torch_us_per_region")
    workloads = {"large": (8, 512, 60), "small": (1, 64, 100)}
    if quick:
        workloads = {"large": (2, 32, 5), "small": (1, 8, 5)}
    d, layers, heads = (1024, 12, 16) if not quick else (64, 2, 4)
    out["throughput"] = {}
    for label, (bs, seq, iters) in workloads.items():
        progress(f"throughput {label}: bs {bs} seq {seq}")
        out["throughput"][label] = throughput(cuda, label, bs, seq, iters, 2 if quick else args.rounds,
                                              configs, d, layers, heads, warm_s=0.5 if quick else 4.0)
    tp = out["throughput"]

    def loss(name: str) -> dict:
        return {label: tp[label]["configs"][name]["loss_pct_median"] for label in tp}

    out["tps_loss_pct_default"] = loss("gpuscope_default")
    out["tps_loss_pct_full"] = loss("gpuscope_full_partition")
    out["tps_loss_pct_full_exact"] = loss("gpuscope_full")
    out["tps_loss_pct_full_python"] = loss("gpuscope_full_partition_python")
    out["tps_loss_pct_full_exact_python"] = loss("gpuscope_full_python")
    out["tps_loss_pct_raw_records"] = loss("raw_records")
    out["tps_loss_pct_naive_torch"] = loss("naive_torch")
    out["tps_loss_pct_profiler"] = loss("torch_profiler")

    def in_context_ratio(name: str) -> dict:
        """CPU added per forward by ``name`` over that of two raw records per region (same regions)."""
        return {label: tp[label]["configs"][name]["main_thread_cpu_us_added_per_forward"]
                / max(1e-9, tp[label]["configs"]["raw_records"]["main_thread_cpu_us_added_per_forward"])
                for label in tp}

    out["in_context_ratio_to_raw_records"] = in_context_ratio("gpuscope_full")
    out["in_context_ratio_to_raw_records_python"] = in_context_ratio("gpuscope_full_python")
    if cuda:
        progress("accuracy against CUPTI")
        acc = accuracy(5 if quick else 30, 50 if quick else 300)
        out["accuracy"] = acc
        out["accuracy_pct_ms_kernel"] = acc["accuracy_pct_ms_kernel"]
        out["accuracy_us_short_region"] = acc["accuracy_us_short_region"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out, out, indent=1, default=float)
    print(f"\nwrote {args.out}\n")
    print(f"{'':28s} {'large':>10s} {'small':>10s}")
    for key in ("tps_loss_pct_raw_records", "tps_loss_pct_default", "tps_loss_pct_full",
                "tps_loss_pct_full_exact", "tps_loss_pct_full_python", "tps_loss_pct_full_exact_python",
                "tps_loss_pct_naive_torch", "tps_loss_pct_profiler", "in_context_ratio_to_raw_records",
                "in_context_ratio_to_raw_records_python"):
        row = out[key]
        print(f"{key:34s} {row.get('large', float('nan')):10.2f} {row.get('small', float('nan')):10.2f}")
    for key in ("raw_record_us", "hot_path_us_per_region", "hot_path_us_per_region_python",
                "naive_torch_us_per_region",
                "accuracy_pct_ms_kernel", "accuracy_us_short_region"):
        if out.get(key) is not None:
            print(f"{key:34s} {out[key]:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
