"""`gpuscope share` on workloads unlike the matmul pair it was tuned on, each mix also unmanaged.

Workloads (each a separate process, plain PyTorch; a step ends with a host sync):
- train: a CNN training step (bf16 autocast, SGD, `loss.item()` every step) with ~3 ms of host work
  per step, as a data loader and Python leave between steps;
- encoder: a 6-layer transformer encoder forward, batch 16 x 256;
- graph: a captured CUDA graph of 24 matmul blocks, replayed;
- generate: a Llama-shaped Hugging Face model (random weights) generating 16 tokens, batch 1;
- small: ResNet-18 batch-1 inference, back to back (launch-bound);
- compiled: a `torch.compile`d MLP (Triton kernels, launched through Triton's own launcher).

Each workload's alone rate is measured first (and again after the mixes: ``alone_drift``, the ratio,
says how far the host's speed moved meanwhile); then each mix runs unmanaged (plain time-slicing),
managed with draining hand-overs (the default) and managed with overlapping hand-overs, one after the
other. Per tenant: its fraction of its alone rate, and the worst 5 s window; per mix and variant: the
sum of the fractions (the GPU's useful work) and the controller's CPU. The mix's headline fields
(``tenants``, ``sum_managed``, ``sum_unmanaged``, ``cpu_core_pct``) are the default (drain) run's.

Then a latency tenant (ResNet-18 batch 1, open loop at ``--latency-rate`` requests/s, priority 1,
share 0.3) runs, for each GPU-bound class, alone and then beside it unmanaged and managed: its p99
(arrival to result) against its alone run just before, and the hog's fraction. With
``--latency-rounds N`` that is repeated N times per class (the managed and unmanaged runs in the other
order every second round), and the row holds the medians and each round: the host's p99 tail moves
from run to run (1.54x and 0.94x beside the same hog in two runs a few hours apart).

Usage (a GPU host, the preload library built):
    PYTHONPATH=src python benchmarks/share_workloads_bench.py --out X.json
    python benchmarks/share_workloads_bench.py --plot X.json --plot-out X.png   # each tenant over time
    python benchmarks/share_workloads_bench.py --plot X.json --plot-variants --plot-out V.png
    python benchmarks/share_workloads_bench.py --plot X.json --plot-latency --plot-out L.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import logger, percentile, rnd, write_json  # noqa: E402
from share_bench import (  # noqa: E402
    LEDGER,
    Controller,
    _helper_cpu_s,
    _helper_wakeups,
    _lib,
    helper_wakeups_per_s,
    rate,
    sleep_until,
)

from gpuscope.contract import catalogue as cat  # noqa: E402
from gpuscope.share.settings import SUGGESTED_STARVED_BELOW  # noqa: E402

log = logger("share-workloads")
MIXES = {
    "train+encoder 70/30": (("train", 0.7), ("encoder", 0.3)),
    "train+encoder+compiled 50/30/20": (("train", 0.5), ("encoder", 0.3), ("compiled", 0.2)),
    "train+encoder+graph 50/30/20": (("train", 0.5), ("encoder", 0.3), ("graph", 0.2)),
    "generate+small+encoder 34/33/33": (("generate", 0.34), ("small", 0.33), ("encoder", 0.33)),
}
#: managed variants: the controller's flags (``drain`` the default hand-over and queue)
VARIANTS = {"unmanaged": None, "drain": ("--share.handover", "drain"),
            "overlap": ("--share.handover", "overlap"),
            # the holder's usual queue beside a latency tenant too (the default gives it a short one;
            # beside tenants of equal priority, as in the mixes, the holder keeps the usual one anyway)
            "drain-usual-queue": ("--share.handover", "drain", "--share.beside-queue", "0"),
            # every tenant probed in turn each second, however steady its probes (no back-off)
            "drain-probe-every-round": ("--share.handover", "drain", "--share.probe-backoff", "1"),
            # a probe every 5 s instead of every second: what the probes themselves cost a latency tenant
            "drain-rare-probes": ("--share.handover", "drain", "--share.probe-every", "5"),
            # a tenant starved beside the holder (its waits for the GPU and its launches) moved to turns
            "drain-starved": ("--share.handover", "drain",
                              "--share.starved-below", str(SUGGESTED_STARVED_BELOW)),
            # the one tenant taking turns while the others run beside it held to a duty
            "drain-lone": ("--share.handover", "drain", "--share.lone-holder", "duty"),
            # each burst of a tenant of higher priority beside the holder holds the holder's launches
            "drain-hold": ("--share.handover", "drain", "--share.priority-hold", "on")}
MANAGED = "drain"  # the default hand-over: the headline figures
WINDOW_S = 5.0
TIMELINE_S = 1.0
#: The controller's gauges read halfway through a managed mix (they say nothing once the tenants left).
MID_RUN_GAUGES = tuple(m.name for m in (cat.SHARE_BUSY_RATIO, cat.SHARE_DUTY_RATIO,
                                         cat.SHARE_BESIDE_THROUGHPUT, cat.SHARE_BINDING))
HOGS = ("train", "encoder", "compiled", "graph")  # the GPU-bound classes a latency tenant runs beside


# --------------------------------------------------------------------------------------------------
# Workers

def _train():
    import torch

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 128, 3, padding=1),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(128, 10)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(64, 3, 96, 96, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # the step's sync
        end = time.perf_counter() + 0.003  # host work between steps (data loading, Python)
        while time.perf_counter() < end:
            pass

    return step


def _encoder():
    import torch

    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6).cuda().to(torch.bfloat16).eval()
    x = torch.randn(16, 256, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        with torch.no_grad():
            model(x)
        torch.cuda.synchronize()

    return step


def _graph():
    import torch

    w = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(24)]
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up on a side stream before capture, as PyTorch asks
            h = x
            for m in w:
                h = torch.relu(h @ m)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = x
        for m in w:
            h = torch.relu(h @ m)

    def step() -> None:
        graph.replay()
        torch.cuda.synchronize()

    return step


def _generate():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    model = LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (1, 32), device="cuda")

    def step() -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()

    return step


def _small():
    import torch
    import torchvision

    model = torchvision.models.resnet18().cuda().eval()
    x = torch.randn(1, 3, 224, 224, device="cuda")

    def step() -> None:
        with torch.no_grad():
            model(x)
        torch.cuda.synchronize()

    return step


def _compiled():
    import torch

    layers = [m for _ in range(8) for m in (torch.nn.Linear(2048, 2048), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers)
    model = torch.compile(model.cuda().to(torch.bfloat16).eval())
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        with torch.no_grad():
            model(x)
        torch.cuda.synchronize()

    return step


WORKLOADS = {"train": _train, "encoder": _encoder, "graph": _graph, "generate": _generate, "small": _small,
             "compiled": _compiled}


def wait_for_start() -> float:
    """Tell the orchestrator this worker is warm, then wait for the common start time it sends (a
    worker that compiles can take half a minute: a fixed warm-up wait left it late)."""
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    sleep_until(start_at)
    return start_at


def latency_worker(rate_per_s: float, seconds: float) -> dict:
    """Open loop: request i arrives at start + i / rate and is served as soon as the previous one is
    done; its latency runs from its arrival to its result on the host."""
    step = _small()
    for _ in range(20):
        step()
    start_at = wait_for_start()
    latencies = []
    i = 0
    while True:
        arrival = start_at + i / rate_per_s
        if arrival >= start_at + seconds:
            break
        sleep_until_precise(arrival)
        step()
        latencies.append(time.time() - arrival)
        i += 1
    return {"latencies_s": latencies}


def sleep_until_precise(t: float) -> None:
    left = t - time.time()
    if left > 0.002:
        time.sleep(left - 0.001)
    while time.time() < t:
        pass


def worker(name: str, seconds: float) -> dict:
    import torch

    torch.manual_seed(0)
    step = WORKLOADS[name]()
    for _ in range(5):  # warm-up: allocator, cuBLAS handles, kernel caches
        step()
    start_at = wait_for_start()
    helper0, wakeups0 = _helper_cpu_s(), _helper_wakeups()
    stamps = []
    end = start_at + seconds
    while time.time() < end:
        step()
        stamps.append(time.time())
    # the gpuscope-share helper threads' CPU over the measured run (0 when not under the library), and
    # how often they slept and woke: against the tenant's steps a second, whether a helper follows
    # each step's window (the helpers of the mix with a graph loop took 1.6% of a core on an H100,
    # which tenant's is not known)
    return {"stamps": stamps, "helper_cpu_pct": 100 * (_helper_cpu_s() - helper0) / seconds,
            "helper_wakeups_per_s": (_helper_wakeups() - wakeups0) / seconds}


# --------------------------------------------------------------------------------------------------
# Orchestration

def spawn(name: str, seconds: float, tenant: str | None, *, role: str = "worker") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if tenant:
        env.update(LD_PRELOAD=_lib(), GPUSCOPE_SHARE_TENANT=tenant, GPUSCOPE_SHARE_LEDGER=LEDGER)
    argv = [sys.executable, os.path.abspath(__file__), role, name, str(seconds)]
    # stderr to a file: compile warnings can fill a pipe nobody reads until the worker ends
    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed with the worker's result)
    p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    p.err_file = err  # type: ignore[attr-defined]
    return p


def _stderr_of(p: subprocess.Popen) -> str:
    p.err_file.seek(0)  # type: ignore[attr-defined]
    return p.err_file.read()[-1500:]  # type: ignore[attr-defined]


def release(procs: list[subprocess.Popen], offsets: list[float] | None = None, lead_s: float = 0.5) -> float:
    """Wait until every worker is warm, then send each its start time (start + its offset)."""
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            p.wait(timeout=60)
            raise RuntimeError(f"worker failed while warming up: {_stderr_of(p)}")
    start = time.time() + lead_s
    for p, offset in zip(procs, offsets or [0.0] * len(procs), strict=True):
        p.stdin.write(f"{start + offset}\n")
        p.stdin.close()
    return start


def result_of(p: subprocess.Popen) -> dict:
    out = p.stdout.read()  # its stdin was closed by release(): nothing to communicate
    p.wait(timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"worker failed: {_stderr_of(p)}")
    return json.loads(out.strip().splitlines()[-1])


def collect(p: subprocess.Popen) -> list[float]:
    return result_of(p)["stamps"]


def counters(ctl: dict) -> list[str]:
    """The stopped controller's series (its /metrics without the comment lines)."""
    return [ln for ln in ctl["metrics"] if not ln.startswith("#")]


def run_latency(hog: str | None, flags: tuple[str, ...] | None, seconds: float, rate_per_s: float,
                alone: dict[str, float], port: int) -> dict:
    """The latency tenant (priority 1, share 0.3) alone or beside ``hog`` (share 0.7), under a
    controller with ``flags`` (None: unmanaged)."""
    managed = flags is not None
    controller = Controller("lat=0.3:1,hog=0.7", "events", port, *flags) if managed else None
    lat = spawn(str(rate_per_s), seconds, "lat" if managed else None, role="latency")
    hog_p = spawn(hog, seconds, "hog" if managed else None) if hog else None
    start = release([lat, hog_p] if hog_p else [lat])
    sleep_until(start)
    mid_run = None
    if controller:
        controller.mark()
        # the tenants' busy ratios and duties while both run (gone once they left): whether a duty
        # held the latency tenant's requests back
        sleep_until(start + seconds / 2)
        mid_run = [ln for ln in controller.scrape() if ln.split("{")[0] in MID_RUN_GAUGES]
    latencies = result_of(lat)["latencies_s"]
    out = {"p99_ms": rnd(1e3 * percentile(latencies, 99), 2),
           "p50_ms": rnd(1e3 * percentile(latencies, 50), 2), "requests": len(latencies)}
    if hog_p:
        out["hog_fraction"] = rnd(rate(collect(hog_p), start, start + seconds) / alone[hog])
    if controller:
        ctl = controller.stop()
        out["cpu_core_pct"] = rnd(ctl["cpu_core_pct"])
        # the latency tenant's busy ratio, duty and gate states at the end: why its requests waited
        out["controller_metrics"] = counters(ctl)
        out["controller_mid_run"] = mid_run
    return out


def measure_alone(workloads: list[str], seconds: float) -> dict[str, float]:
    """Each workload's steps a second alone, one after the other, all warmed up first."""
    procs = {w: spawn(w, seconds, None) for w in workloads}
    start = release(list(procs.values()), [i * (seconds + 1) for i in range(len(workloads))])
    rates = {}
    for i, (w, pr) in enumerate(procs.items()):
        lo = start + i * (seconds + 1)
        rates[w] = rate(collect(pr), lo, lo + seconds)
        log(f"alone {w}: {rates[w]:.1f} steps/s")
    return rates


def run_mix(tenants: tuple, variant: str, seconds: float, alone: dict[str, float], port: int,
            ) -> dict:
    names = [f"t{i}-{w}" for i, (w, _) in enumerate(tenants)]
    controller = None
    if variant != "unmanaged":
        shares = ",".join(f"{n}={s}" for n, (_, s) in zip(names, tenants, strict=True))
        controller = Controller(shares, "events", port, *VARIANTS[variant])
    procs = [spawn(w, seconds, n if controller else None) for n, (w, _) in zip(names, tenants, strict=True)]
    start = release(procs)
    sleep_until(start)
    mid_run = None
    wakeups: dict[str, dict[str, float]] = {}
    if controller:
        controller.mark()
        first = (time.time(), controller.scrape())
        # the gauges of tenants beside the holder (duty, estimated throughput) exist only while they
        # run: one look halfway through; the helpers' wake-ups by reason over the first half
        sleep_until(start + seconds / 2)
        second = (time.time(), controller.scrape())
        mid_run = [ln for ln in second[1] if ln.split("{")[0] in MID_RUN_GAUGES]
        wakeups = helper_wakeups_per_s(first, second)
    results = [result_of(p) for p in procs]
    stamps = [r["stamps"] for r in results]
    ctl = controller.stop() if controller else None
    rows = []
    for n, (w, share), st in zip(names, tenants, stamps, strict=True):
        fraction = rate(st, start, start + seconds) / alone[w]
        windows = [rate(st, t, t + WINDOW_S) / alone[w]
                   for t in (start + WINDOW_S * k for k in range(1, int(seconds // WINDOW_S)))]
        timeline = [rnd(rate(st, start + TIMELINE_S * k, start + TIMELINE_S * (k + 1)) / alone[w])
                    for k in range(int(seconds // TIMELINE_S))]
        # below its share is what a tenant is promised against; above it is spare capacity it was lent
        rows.append({"name": n, "workload": w, "share": share, "fraction": rnd(fraction),
                     "worst_window_pts": rnd(max((abs(v - share) * 100 for v in windows), default=None), 2),
                     "worst_window_below_share_pts": rnd(max((max(0.0, share - v) * 100 for v in windows),
                                                             default=None), 2),
                     "timeline": timeline})
    for row, st in zip(rows, stamps, strict=True):
        row["steps_per_s"] = rnd(rate(st, start, start + seconds), 1)  # the fraction's numerator
    if controller:
        for row, r in zip(rows, results, strict=True):
            row.update(helper_cpu_pct=rnd(r["helper_cpu_pct"]),
                       helper_wakeups_per_s=rnd(r["helper_wakeups_per_s"], 1),
                       helper_wakeups_per_s_by_reason=wakeups.get(row["name"], {}))
    helpers_pct = sum(r["helper_cpu_pct"] for r in results)
    return {"tenants": rows, "sum": rnd(sum(r["fraction"] for r in rows)),
            "cpu_core_pct": rnd(ctl["cpu_core_pct"] + helpers_pct) if ctl else None,
            "controller_cpu_core_pct": rnd(ctl["cpu_core_pct"]) if ctl else None,
            "helpers_cpu_core_pct": rnd(helpers_pct) if ctl else None,
            # the controller's counters at the end (lent and reclaimed turns, charges, busy ratios)
            "controller_metrics": counters(ctl) if ctl else None,
            "controller_mid_run": mid_run}


def _panels(src: str, width: float) -> tuple[dict, object, list]:
    """A results file and a figure with one panel per mix (``width`` inches each): (data, figure,
    [(axes, mix), ...])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src) as f:
        data = json.load(f)
    mixes = data["mixes"]
    fig, axes = plt.subplots(1, len(mixes), figsize=(width * len(mixes), 3.8), sharey=True, squeeze=False)
    return data, fig, list(zip(axes[0], mixes, strict=True))


def finish(fig, first_ax, ylabel: str, title: str, dst: str) -> None:
    """The figure's y label (on its first panel), title and file."""
    first_ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def plot(src: str, dst: str) -> None:
    """One panel per mix: each tenant's fraction of its alone rate over time, managed (solid) and
    unmanaged (dotted), its share as a band."""
    data, fig, panels = _panels(src, 5.5)
    for ax, mix in panels:
        pairs = zip(mix[MANAGED]["tenants"], mix["unmanaged"]["tenants"], strict=True)
        for i, (managed, plain) in enumerate(pairs):
            color = f"C{i}"
            ts = [TIMELINE_S * (k + 0.5) for k in range(len(managed["timeline"]))]
            ax.plot(ts, [100 * v for v in managed["timeline"]], "-", color=color, label=managed["name"])
            ax.plot(ts, [100 * v for v in plain["timeline"]], ":", color=color)
            ax.axhspan(100 * managed["share"] - 2, 100 * managed["share"] + 2, color=color, alpha=0.15)
        ax.set_title(f"{mix['name']}: sum {mix['sum_managed']} managed, {mix['sum_unmanaged']} unmanaged",
                     fontsize=9)
        ax.set_xlabel(f"seconds ({TIMELINE_S:g} s windows)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    finish(fig, panels[0][0], "% of alone (solid: managed, dotted: unmanaged)",
           f"gpuscope share ({MANAGED} hand-overs) on realistic tenants, {data['date']}", dst)


def plot_variants(src: str, dst: str, title: str = "gpuscope share variants on realistic tenants") -> None:
    """One panel per mix: each tenant's fraction of its alone rate under every variant the file holds
    (bars side by side), its share as a line, and each variant's sum in the legend."""
    data, fig, panels = _panels(src, 6)
    for ax, mix in panels:
        # the variants as the run named them (a file keeps its run's names)
        variants = [k for k, v in mix.items() if isinstance(v, dict) and "tenants" in v]
        names = [t["workload"] for t in mix["unmanaged"]["tenants"]]
        width = 0.8 / len(variants)
        for j, variant in enumerate(variants):
            fractions = [100 * t["fraction"] for t in mix[variant]["tenants"]]
            ax.bar([i + (j - (len(variants) - 1) / 2) * width for i in range(len(names))], fractions, width,
                   label=f"{variant} (sum {mix[variant]['sum']})", color=f"C{j}")
        for i, tenant in enumerate(mix["unmanaged"]["tenants"]):
            ax.hlines(100 * tenant["share"], i - 0.45, i + 0.45, colors="black", linestyles="--")
        ax.set_xticks(range(len(names)), names)
        ax.set_title(mix["name"], fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    finish(fig, panels[0][0], "% of alone rate (dashed: share)", f"{title}, {data['date']}", dst)


def plot_latency(src: str, dst: str) -> None:
    """One panel per hog: the latency tenant's p50 and p99 alone, unmanaged, at the defaults and under
    each latency variant the file holds (bars), the hog's fraction of its alone rate in each label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src) as f:
        data = json.load(f)
    rows = data["latency"]
    fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 3.8), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        variants = [k for k, v in row.items() if isinstance(v, dict) and "p99_vs_alone" in v]
        p99_alone = row["p99_alone_ms"]
        bars = [("alone", row["p50_alone_ms"], p99_alone, None),
                ("unmanaged", row["p50_ms_unmanaged"], p99_alone * row["p99_vs_alone_unmanaged"],
                 row["hog_fraction_unmanaged"]),
                (MANAGED, row["p50_ms_managed"], p99_alone * row["p99_vs_alone_managed"],
                 row["hog_fraction_managed"]),
                *((v, row[v].get("p50_ms"), p99_alone * row[v]["p99_vs_alone"], row[v]["hog_fraction"])
                  for v in variants)]
        xs = range(len(bars))
        ax.bar([x - 0.2 for x in xs], [b[1] or 0 for b in bars], 0.4, label="p50", color="C0")
        ax.bar([x + 0.2 for x in xs], [b[2] for b in bars], 0.4, label="p99", color="C1")
        ax.axhline(1.3 * p99_alone, color="black", linestyle="--", linewidth=1, label="1.3 x p99 alone")
        ax.set_xticks(list(xs), [b[0] if b[3] is None else f"{b[0]}\nhog {b[3]}" for b in bars], fontsize=7)
        ax.set_title(f"beside {row['hog']} at {row['rate_per_s']:g} requests/s", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    finish(fig, axes[0][0], "latency tenant, ms",
           f"gpuscope share: the latency tenant beside each hog, {data['date']}", dst)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        print(json.dumps(worker(sys.argv[2], float(sys.argv[3]))), flush=True)
        return
    if len(sys.argv) > 2 and sys.argv[1] == "latency":
        result = latency_worker(float(sys.argv[2]), float(sys.argv[3]))
        print(json.dumps(result), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot", metavar="JSON", help="draw a results file instead of measuring")
    p.add_argument("--plot-out", default="share-workloads.png")
    p.add_argument("--plot-variants", action="store_true",
                   help="with --plot: each tenant's fraction under every variant, as bars")
    p.add_argument("--plot-latency", action="store_true",
                   help="with --plot: the latency tenant's p50 and p99 beside each hog, under every variant")
    p.add_argument("--out")
    p.add_argument("--port", type=int, default=9494)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--alone-seconds", type=float, default=6.0)
    p.add_argument("--no-alone-again", dest="alone_again", action="store_false",
                   help="skip measuring each workload alone again after the mixes (alone_drift)")
    p.add_argument("--mixes", default=",".join(MIXES))
    p.add_argument("--latency-rate", type=float, default=150.0, help="the latency tenant's requests/s")
    p.add_argument("--latency-rounds", type=int, default=1, help="rounds of the latency tenant beside each "
                   "hog (alone, unmanaged, managed, each round its own alone run; the order of the last two "
                   "flips each round): the row holds the medians and each round")
    p.add_argument("--hogs", default=",".join(HOGS), help="GPU-bound classes the latency tenant runs beside")
    p.add_argument("--variants", default="unmanaged,drain,overlap",
                   help=f"which of {', '.join(VARIANTS)} to run")
    p.add_argument("--latency-variants", default="", help="managed variants the latency tenant also runs "
                   f"beside each hog, besides {MANAGED} (e.g. drain-usual-queue)")
    p.add_argument("--merge", action="store_true", help="add to --out's mixes and latency rows instead of "
                   "starting a new file (a run split in parts)")
    args = p.parse_args()
    if args.plot:
        drawing = plot_latency if args.plot_latency else plot_variants if args.plot_variants else plot
        drawing(args.plot, args.plot_out)
        return
    if not args.out:
        p.error("--out is required to measure")
    mixes = {name: MIXES[name] for name in args.mixes.split(",") if name}
    variants = [v for v in args.variants.split(",") if v]
    if not {"unmanaged", MANAGED} <= set(variants) or not set(variants) <= set(VARIANTS):
        p.error(f"--variants: give unmanaged and {MANAGED}, optionally overlap")
    out: dict = {"date": time.strftime("%Y-%m-%d"), "seconds": args.seconds, "alone": {}, "mixes": [],
                 "latency": []}
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            earlier = json.load(f)
        out["mixes"], out["latency"] = earlier.get("mixes", []), earlier.get("latency", [])
        # this run's alone rates are its own (the host drifts between runs): kept apart
        out["alone"], out["alone_merged_run"] = earlier.get("alone", {}), {}
    alone = out["alone_merged_run"] if args.merge and "alone_merged_run" in out else out["alone"]

    def save() -> None:
        write_json(args.out, out, indent=1)

    hogs = [h for h in args.hogs.split(",") if h]
    latency_variants = [v for v in args.latency_variants.split(",") if v]
    if not set(latency_variants) <= set(VARIANTS) - {"unmanaged", MANAGED}:
        p.error(f"--latency-variants: of {', '.join(sorted(set(VARIANTS) - {'unmanaged', MANAGED}))}")
    needed = sorted({w for tenants in mixes.values() for w, _ in tenants} | set(hogs))
    alone.update(measure_alone(needed, args.alone_seconds))
    save()
    for name, tenants in mixes.items():
        entry = {"name": name}
        for variant in variants:
            entry[variant] = run_mix(tenants, variant, args.seconds, alone, args.port)
            shown = ", ".join(f"{r['workload']} {r['fraction']} (share {r['share']}, worst "
                              f"{r['worst_window_pts']})" for r in entry[variant]["tenants"])
            log(f"{name} {variant}: {shown}; sum {entry[variant]['sum']}")
            save()
        entry.update(tenants=entry[MANAGED]["tenants"], sum_managed=entry[MANAGED]["sum"],
                     sum_unmanaged=entry["unmanaged"]["sum"], cpu_core_pct=entry[MANAGED]["cpu_core_pct"])
        out["mixes"].append(entry)
        save()
    if mixes and args.alone_again:
        # The host's speed drifts within minutes (an encoder alone read 683 and 559 steps/s in two runs
        # of one hour on one H100), and every fraction is against the rate at the start: measured again
        # after the mixes, the ratio says how far the fractions can be trusted.
        workloads = sorted({w for tenants in mixes.values() for w, _ in tenants})
        out["alone_after_mixes"] = measure_alone(workloads, args.alone_seconds)
        out["alone_drift"] = {w: rnd(out["alone_after_mixes"][w] / alone[w]) if alone[w] else None
                              for w in workloads}
        log(f"alone after the mixes ÷ before: {out['alone_drift']}")
        save()
    def latency(hog: str | None, variant: str) -> dict:
        return run_latency(hog, VARIANTS[variant], args.seconds, args.latency_rate, alone, args.port)

    if not hogs:
        return
    def latency_round(hog: str, flip: bool) -> dict:
        """The tenant alone, then beside ``hog`` unmanaged and managed (in the other order when
        ``flip``), then under each latency variant: each ratio against this round's alone run. The host's
        speed drifts within minutes (a decode loop alone read p99 8.1 ms at one run's start and 12.0 ms
        at its end), more than the 1.3x being checked, so every round has its own alone run."""
        alone_lat = latency(None, "unmanaged")
        log(f"latency tenant alone at {args.latency_rate:g}/s: p99 {alone_lat['p99_ms']} ms")
        if flip:
            managed, plain = latency(hog, MANAGED), latency(hog, "unmanaged")
        else:
            plain, managed = latency(hog, "unmanaged"), latency(hog, MANAGED)
        row = {"hog": hog, "rate_per_s": args.latency_rate, "p99_alone_ms": alone_lat["p99_ms"],
               "p99_vs_alone_managed": rnd(managed["p99_ms"] / alone_lat["p99_ms"], 2),
               "p99_vs_alone_unmanaged": rnd(plain["p99_ms"] / alone_lat["p99_ms"], 2),
               "hog_fraction_managed": managed["hog_fraction"],
               "hog_fraction_unmanaged": plain["hog_fraction"],
               "cpu_core_pct": managed["cpu_core_pct"],
               "controller_metrics": managed["controller_metrics"],
               "controller_mid_run": managed["controller_mid_run"], "p50_ms_managed": managed["p50_ms"],
               "p50_ms_unmanaged": plain["p50_ms"], "p50_alone_ms": alone_lat["p50_ms"]}
        for variant in latency_variants:  # the same beside the hog under other flags
            other = latency(hog, variant)
            row[variant] = {"p99_vs_alone": rnd(other["p99_ms"] / alone_lat["p99_ms"], 2),
                            "p50_ms": other["p50_ms"], "hog_fraction": other["hog_fraction"],
                            "cpu_core_pct": other["cpu_core_pct"],
                            "controller_metrics": other["controller_metrics"],
                            "controller_mid_run": other["controller_mid_run"]}
            log(f"latency beside {hog}, {variant}: p99 {row[variant]['p99_vs_alone']}x alone")
        log(f"latency beside {hog}: p99 {row['p99_vs_alone_managed']}x alone managed, "
            f"{row['p99_vs_alone_unmanaged']}x unmanaged; hog {row['hog_fraction_managed']} / "
            f"{row['hog_fraction_unmanaged']}")
        return row

    for hog in hogs:
        rounds = [latency_round(hog, flip=r % 2 == 1) for r in range(args.latency_rounds)]
        row = dict(rounds[-1])
        if len(rounds) > 1:
            # the medians over the rounds, each round's figures kept as measured
            for key in ("p99_vs_alone_managed", "p99_vs_alone_unmanaged", "hog_fraction_managed",
                        "hog_fraction_unmanaged", "cpu_core_pct"):
                row[key] = rnd(statistics.median(r[key] for r in rounds), 3)
            for variant in latency_variants:
                for key in ("p99_vs_alone", "hog_fraction", "cpu_core_pct"):
                    row[variant][key] = rnd(statistics.median(r[variant][key] for r in rounds), 3)
            kept = ("controller_metrics", "controller_mid_run")  # the last round's, in the row itself
            row["rounds"] = [{k: v for k, v in r.items() if k not in kept} for r in rounds]
            for r in row["rounds"]:
                for variant in latency_variants:
                    r[variant] = {k: v for k, v in r[variant].items() if k not in kept}
        out["latency"].append(row)
        save()
    print(json.dumps({"mixes": [{k: m[k] for k in ("name", "sum_managed", "sum_unmanaged", "cpu_core_pct")}
                                for m in out["mixes"]], "latency": out["latency"]}, indent=1))


if __name__ == "__main__":
    main()
