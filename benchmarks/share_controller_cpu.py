"""The share controller's CPU and wake-ups on any machine: tenants on a real-time fake GPU.

`gpuscope share`'s controller never touches the GPU in events mode: what it costs depends on how often
it wakes and what each wake-up does, which a fake driver whose "GPU" runs kernels in real time
(tests/share/fake_libcuda.c with FAKE_CUDA_REALTIME=1; each process has a GPU of its own, so nothing
here measures contention) shows as well as a real one. The scenarios, in interleaved rounds per
variant of the controller's flags:

- ``turns``: two GPU-bound loops (ten 1.4 ms kernels, then a sync) at 70/30, equal priority: the
  tenants take turns, handed over by the controller;
- ``beside``: a latency-bound loop (steps of 300 launches of 5 µs kernels with 20 µs of CPU between,
  a sync per step; share 0.3, priority 1) beside such a GPU-bound loop (0.7);
- ``graph``: the H200's train+encoder+graph mix in shape: a training-like loop (ten 300 µs kernels, a
  sync, 6 ms on the host: it runs beside the holder) at 0.5, a GPU-bound loop at 0.3 and a graph
  replayed and synced every step (400 µs, then a context synchronize) at 0.2; the two GPU-bound
  tenants take turns;
- ``encoder``: the latency-bound loop beside a launch-bound holder (100 kernels of 40 µs with 20 µs
  of Python between, then a sync: busy most of the time, so it takes turns, but never queue-bound);
- ``lend``: the H100's training + encoder 70/30 mix in shape: a training-like loop busy about 75% of
  its time (ten 300 µs kernels, a sync, 1 ms on the host) at 0.7, so it takes turns, and lends each
  one to a GPU-bound loop (0.3) at its step's sync and takes it back at its next launch;
- ``graph-turns``: the H100's train+encoder+graph mix as it ran there: as ``graph``, with the
  launch-bound ``encoder`` loop in the GPU-bound loop's place (busy about two thirds of its time, so it
  takes turns with the graph loop, and syncs every step);
- ``graph-gaps``: as ``graph-turns``, with the encoder-like loop back on the GPU 0.1 ms after each
  sync, and 0.5 ms after one in seven (the Python before a model's first kernel varies: on an H100 the
  encoder's helper ended its 300 µs watch for quiet after a sync about 1.5 times a step);
- ``graph-spread``: as ``graph-gaps``, the encoder-like loop back 0.1, 0.2, 0.3, 0.4 and 0.5 ms after
  its syncs in turn (as an H100's encoder reached its next first kernel 0.1-0.5 ms after its sync);
- ``all-beside``: the H200's mixes as they ran there: three training-like loops (as in ``graph``) at
  50/30/20, each busy about a third of its time, so all run beside one another and nobody takes turns.

    PYTHONPATH=src python benchmarks/share_controller_cpu.py \
        --rounds 2 --out benchmarks/results/share-controller-cpu-sixth.json

Reported per round: the controller's CPU (% of a core), its wake-ups a second (voluntary context
switches of all its threads) and CPU per wake-up; each tenant's share of the rounds' iterations; the
latency tenant's p50/p99 step and the time it was held at the gate; each tenant's helper CPU and
wake-ups a second, and those wake-ups by what the helper slept on (``helper_wakeups_per_s_by_reason``,
from the controller's ``gpuscope_share_helper_wakeups_total`` between two scrapes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from benchlib import write_json  # noqa: E402
from share_bench import (  # noqa: E402
    Controller,
    _helper_cpu_s,
    _helper_wakeups,
    collect,
    helper_wakeups_per_s,
    pct,
    sleep_until,
)

from gpuscope.contract import catalogue as cat  # noqa: E402

LEDGER = "/dev/shm/gpuscope-share-cpu-bench"
#: the scenarios reported by each tenant's iterations (the others by the hog's share or the latency tenant)
ITERATION_SCENARIOS = ("graph", "graph-turns", "graph-gaps", "graph-spread", "lend", "all-beside")


def worker(kind: str, seconds: float, start_at: float) -> dict:
    """A tenant: launches through libcuda.so.1 (the fake one, preloaded with the library)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    launch = cuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    event = ctypes.c_void_p()
    cuda.cuEventCreate(ctypes.byref(event), 1)

    def sync() -> None:
        cuda.cuEventRecord(event, None)
        cuda.cuEventSynchronize(event)

    while time.time() < start_at:
        time.sleep(0.001)
    helper0, helper_wakeups0, cpu0 = _helper_cpu_s(), _helper_wakeups(), time.process_time()
    stamps, steps = [], []
    end = time.time() + seconds
    while time.time() < end:
        if kind == "graph":  # few long launches, each waited for
            cuda.cuGraphLaunch(None, None)
            cuda.cuCtxSynchronize()
            stamps.append(time.time())
        elif kind in ("train", "train-busy"):
            for _ in range(10):
                launch(None, 1, 1, 1, 300, 1, 1, 0, None, None, None)
            sync()
            time.sleep(0.006 if kind == "train" else 0.001)
            stamps.append(time.time())
        elif kind == "hog":
            for _ in range(10):
                launch(None, 1, 1, 1, 1400, 1, 1, 0, None, None, None)
            sync()
            stamps.append(time.time())
        elif kind.startswith("encoder"):  # launch-bound but busy most of its time: it takes turns
            for _ in range(100):
                launch(None, 1, 1, 1, 40, 1, 1, 0, None, None, None)
                spin = time.perf_counter() + 20e-6
                while time.perf_counter() < spin:
                    pass
            sync()
            if kind == "encoder-gaps":  # back on the GPU 0.1 ms after its sync, 0.5 ms one step in seven
                spin = time.perf_counter() + (500e-6 if len(stamps) % 7 == 6 else 100e-6)
                while time.perf_counter() < spin:  # the Python before the next forward's first kernel
                    pass
            elif kind == "encoder-spread":  # back 0.1, 0.2, 0.3, 0.4 or 0.5 ms after its sync, in turn
                spin = time.perf_counter() + 100e-6 * (1 + len(stamps) % 5)
                while time.perf_counter() < spin:
                    pass
            stamps.append(time.time())
        else:
            t0 = time.perf_counter()
            for _ in range(300):
                launch(None, 1, 1, 1, 5, 1, 1, 0, None, None, None)
                spin = time.perf_counter() + 20e-6  # the Python between a model's kernels
                while time.perf_counter() < spin:
                    pass
            sync()
            steps.append(time.perf_counter() - t0)
            stamps.append(time.time())
    stats = (ctypes.c_uint64 * 8)()
    ctypes.CDLL(None).gpuscope_share_stats(stats)
    return {"stamps": stamps, "steps": steps, "throttled_s": stats[3] / 1e9, "windows": stats[5],
            "launches": stats[0], "helper_cpu_pct": 100 * (_helper_cpu_s() - helper0) / seconds,
            "helper_wakeups_per_s": (_helper_wakeups() - helper_wakeups0) / seconds,
            "process_cpu_pct": 100 * (time.process_time() - cpu0) / seconds}


def build_fake_driver(folder: str) -> None:
    if shutil.which("gcc") is None:
        raise SystemExit("gcc is needed to build the fake driver")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", os.path.join(folder, "libcuda.so.1"),
                    os.path.join(ROOT, "tests", "share", "fake_libcuda.c")], check=True)


def spawn(kind: str, tenant: str, seconds: float, start_at: float, fake: str) -> subprocess.Popen:
    from gpuscope.share.preload import library_path

    env = dict(os.environ, LD_PRELOAD=library_path(), LD_LIBRARY_PATH=fake, FAKE_CUDA_REALTIME="1",
               FAKE_CUDA_GRAPH_US="400",
               FAKE_CUDA_LOG="/dev/null", GPUSCOPE_SHARE_TENANT=tenant, GPUSCOPE_SHARE_LEDGER=LEDGER)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", kind, str(seconds),
                             str(start_at)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


#: each scenario's shares and tenants as (worker kind, tenant name); the module docstring says what
#: each one stands for ("beside": a latency-bound loop beside a GPU-bound one)
SCENARIOS = {
    "turns": ("a=0.7,b=0.3", (("hog", "a"), ("hog", "b"))),
    "beside": ("llm=0.3:1,hog=0.7", (("llm", "llm"), ("hog", "hog"))),
    "lend": ("train=0.7,hog=0.3", (("train-busy", "train"), ("hog", "hog"))),
    "graph": ("train=0.5,hog=0.3,graph=0.2", (("train", "train"), ("hog", "hog"), ("graph", "graph"))),
    "graph-turns": ("train=0.5,enc=0.3,graph=0.2",
                    (("train", "train"), ("encoder", "enc"), ("graph", "graph"))),
    "graph-gaps": ("train=0.5,enc=0.3,graph=0.2",
                   (("train", "train"), ("encoder-gaps", "enc"), ("graph", "graph"))),
    "graph-spread": ("train=0.5,enc=0.3,graph=0.2",
                     (("train", "train"), ("encoder-spread", "enc"), ("graph", "graph"))),
    "encoder": ("llm=0.3:1,hog=0.7", (("llm", "llm"), ("encoder", "hog"))),
    "all-beside": ("train=0.5,second=0.3,third=0.2",
                   (("train", "train"), ("train", "second"), ("train", "third"))),
}


def one_round(scenario: str, flags: list[str], seconds: float, fake: str, port: int) -> dict:
    shares, tenants = SCENARIOS[scenario]
    ctl = Controller(shares, "events", port, *flags, ledger=LEDGER)
    start = time.time() + 1.0
    procs = [spawn(kind, name, seconds, start, fake) for kind, name in tenants]
    sleep_until(start)
    ctl.mark()
    # the helpers' wake-ups by reason, from the controller's /metrics, while every tenant runs
    first = (time.time(), ctl.scrape())
    sleep_until(start + max(0.5, seconds - 0.5))
    wakeups = helper_wakeups_per_s(first, (time.time(), ctl.scrape()))
    results = {name: collect(p) for (_, name), p in zip(tenants, procs, strict=True)}
    c = ctl.stop()
    counts = {name: sum(1 for s in r["stamps"] if start + 1 <= s < start + seconds)
              for name, r in results.items()}
    out = {"scenario": scenario, "flags": flags, "controller_cpu_pct": c["cpu_core_pct"],
           "wakeups_per_s": c["wakeups_per_s"], "cpu_us_per_wakeup": c["cpu_us_per_wakeup"],
           "throttled_s": {n: r["throttled_s"] for n, r in results.items()},
           "windows": {n: r["windows"] for n, r in results.items()},
           "helper_cpu_pct": {n: r["helper_cpu_pct"] for n, r in results.items()},
           "helper_wakeups_per_s": {n: r["helper_wakeups_per_s"] for n, r in results.items()},
           "helper_wakeups_per_s_by_reason": wakeups,
           "process_cpu_pct": {n: r["process_cpu_pct"] for n, r in results.items()}}
    if scenario == "turns":
        out["share_a"] = counts["a"] / max(1, counts["a"] + counts["b"])
    elif scenario in ITERATION_SCENARIOS:
        out["iterations"] = counts
        out["lends"] = next((float(ln.split()[-1]) for ln in c["metrics"]
                             if ln.startswith(cat.SHARE_LENDS.name)), None)
    else:
        steps = results["llm"]["steps"]
        out.update(llm_steps=len(steps), llm_p50_ms=1e3 * pct(steps, 0.5), llm_p99_ms=1e3 * pct(steps, 0.99),
                   hog_iterations=counts["hog"])
    return out


def plot(src: str, dst: str, label: str) -> None:
    """Each scenario's controller and helper CPU, one bar per value of the rows' ``label`` field (such
    as the library a row ran with), the rounds' medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src) as f:
        rows = json.load(f)["rows"]
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    labels = list(dict.fromkeys(str(r.get(label, "")) for r in rows))
    fig, ax = plt.subplots(figsize=(2.6 * len(scenarios) + 2, 3.6))
    width = 0.8 / len(labels)
    for i, name in enumerate(labels):
        totals = []
        for scenario in scenarios:
            picked = [r for r in rows if r["scenario"] == scenario and str(r.get(label, "")) == name]
            totals.append(statistics.median(r["controller_cpu_pct"] + sum(r["helper_cpu_pct"].values())
                                            for r in picked))
        ax.bar([x + i * width for x in range(len(scenarios))], totals, width, label=name)
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(scenarios))], scenarios)
    ax.set_ylabel("controller + helpers, % of a core")
    ax.axhline(0.5, color="black", linestyle="--", linewidth=1)  # the target with three tenants
    ax.legend(fontsize=8)
    ax.set_title("gpuscope share's CPU on the CPU host's fake GPU (median of rounds; dashed: 0.5%)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        print(json.dumps(worker(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", metavar="JSON",
                   help="draw a results file instead of measuring (--out: the picture)")
    p.add_argument("--plot-label", default="library", help="the rows' field whose values are the bars")
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scenarios", default="turns,beside,graph")
    p.add_argument("--variant", action="append", default=None,
                   help="controller flags of one variant, space-separated (repeat; default: the defaults)")
    p.add_argument("--port", type=int, default=9417)
    args = p.parse_args()
    if args.plot:
        plot(args.plot, args.out, args.plot_label)
        return
    unknown = [s for s in args.scenarios.split(",") if s not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: {', '.join(map(repr, unknown))} not one of {', '.join(SCENARIOS)}")
    variants = [v.split() for v in (args.variant or [""])]
    rows = []
    with tempfile.TemporaryDirectory() as fake:
        build_fake_driver(fake)
        for rnd in range(args.rounds):
            for scenario in args.scenarios.split(","):
                for flags in variants if rnd % 2 == 0 else variants[::-1]:
                    r = one_round(scenario, flags, args.seconds, fake, args.port)
                    r["round"] = rnd
                    rows.append(r)
                    extra = (f"share a {r['share_a']:.3f}" if scenario == "turns" else
                             f"iterations {r['iterations']}, lends {r['lends']}"
                             if scenario in ITERATION_SCENARIOS else
                             f"llm p50 {r['llm_p50_ms']:.1f} p99 {r['llm_p99_ms']:.1f} ms, held "
                             f"{r['throttled_s']['llm']:.3f} s")
                    print(f"round {rnd} {scenario:6s} {' '.join(flags) or '(defaults)':30s} controller "
                          f"{r['controller_cpu_pct']:.2f}% {r['wakeups_per_s']:.0f} wake-ups/s "
                          f"{r['cpu_us_per_wakeup']:.0f} µs each; helpers "
                          f"{', '.join(f'{v:.2f}%' for v in r['helper_cpu_pct'].values())} "
                          f"({', '.join(f'{v:.0f}' for v in r['helper_wakeups_per_s'].values())} "
                          "wake-ups/s); "
                          f"{extra}",
                          flush=True)
                    write_json(args.out, {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename,
                                          "cpus": os.cpu_count(), "rows": rows}, indent=1)
    for scenario in args.scenarios.split(","):
        for flags in variants:
            mine = [r for r in rows if r["scenario"] == scenario and r["flags"] == flags]
            print(f"{scenario:6s} {' '.join(flags) or '(defaults)':30s} controller median "
                  f"{statistics.median(r['controller_cpu_pct'] for r in mine):.2f}% of a core, "
                  f"{statistics.median(r['wakeups_per_s'] for r in mine):.0f} wake-ups/s")


if __name__ == "__main__":
    main()
