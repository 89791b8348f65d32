"""`gpuscope share` on the fake driver's shared GPU: tenants with host gaps beside GPU-bound ones, on a
machine without a GPU (the CPU stand-in for share_workloads_bench.py, for the scheduling rules only).

The fake libcuda (tests/share/fake_libcuda.c, built here with gcc) runs every process's kernels one
after another on one wall clock shared through a file (FAKE_CUDA_REALTIME, FAKE_CUDA_SHARED_GPU), so
tenants contend for it as for a GPU; tests/share/workload.py is the tenant: ``steps`` (a burst of
kernels, a stream synchronize, host work: a training step) or ``busy`` (GPU-bound, a bounded queue).
Each workload runs alone first; then each mix unmanaged and managed in each variant (``--variants``:
draining or overlapping hand-overs, the turn keeper in C; ``drain-starved``: draining with
``--share.starved-below`` at its suggested value; ``drain-lone``: draining with
``--share.lone-holder duty``), the variants' order reversed every other round
(``--rounds``); per tenant its fraction of its alone rate, per mix the sums. The workloads:
``steps`` (ten 300 µs kernels, a sync, 3 ms on the host), ``busy`` (GPU-bound, 300 µs kernels),
``short`` (one 150 µs kernel, a sync, 0.1 ms on the host: a compiled MLP's step, launch-bound) and
``hog`` (GPU-bound, 4 ms kernels two at a time).

What it cannot show: the GPU's own time-slicing between contexts, launch costs of real drivers, and
anything about real workloads' kernels. Figures depend on the host's load (two cores, loaded, move
them by several points).

Usage:
    PYTHONPATH=src python benchmarks/share_sim_bench.py --out benchmarks/results/share-sim-cpu.json
    PYTHONPATH=src python benchmarks/share_sim_bench.py --rounds 2 --seconds 8 --mixes all \
        --variants unmanaged,drain,drain-starved --out benchmarks/results/share-sim-starved-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from benchlib import logger, rnd, write_json  # noqa: E402

log = logger("share-sim")
#: workload -> (tests/share/workload.py's kind, (kernels a step or batch, each kernel's µs, host ms))
WORKLOADS = {"steps": ("steps", (10, 300, 3)), "busy": ("busy", (10, 300, 3)),
             "short": ("steps", (1, 150, 0.1)), "hog": ("busy", (2, 4000, 0))}
MIXES = {
    "steps+busy 70/30": (("steps", 0.7), ("busy", 0.3)),
    "busy+busy 70/30": (("busy", 0.7), ("busy", 0.3)),
    "steps+busy+steps 50/30/20": (("steps", 0.5), ("busy", 0.3), ("steps", 0.2)),
    "short+hog 25/75": (("short", 0.25), ("hog", 0.75)),
    "steps+busy+short 50/30/20": (("steps", 0.5), ("busy", 0.3), ("short", 0.2)),
}
VARIANTS = ("unmanaged", "drain", "overlap", "drain-starved", "drain-lone")
WORKLOAD = ROOT / "tests" / "share" / "workload.py"


def build_fake(into: Path) -> Path:
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(into / "libcuda.so.1"),
                    str(ROOT / "tests" / "share" / "fake_libcuda.c")], check=True)
    return into


def run(fake: Path, tmp: Path, workloads: list[str], seconds: float,
        tenants: list[str] | None = None) -> list[int]:
    from tests.share.fakecuda import child_env

    gpu = tmp / f"gpu-{time.monotonic_ns()}"
    procs = []
    for i, workload in enumerate(workloads):
        kind, (burst, kernel_us, gap_ms) = WORKLOADS[workload]
        env = child_env(fake, Path(os.devnull), tenant=tenants[i] if tenants else None,
                        ledger=str(tmp / "ledger") if tenants else None)
        env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_SHARED_GPU=str(gpu), WORKLOAD_BURST=str(burst),
                   WORKLOAD_KERNEL_US=str(kernel_us), WORKLOAD_GAP_MS=str(gap_ms))
        procs.append(subprocess.Popen([sys.executable, str(WORKLOAD), kind, str(seconds)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    return [json.loads(p.communicate(timeout=120)[0])["steps"] for p in procs]


def tenant_names(mix: tuple) -> list[str]:
    """A mix's tenants as the controller and the results name them: t<index>-<workload>."""
    return [f"t{i}-{w}" for i, (w, _) in enumerate(mix)]


def run_variant(variant: str, fake: Path, tmp: Path, mix: tuple, seconds: float) -> tuple[list[float], dict]:
    """One mix in one variant: each tenant's steps, and the controller's counters (managed only)."""
    from gpuscope.share.ledger import TenantPolicy
    from gpuscope.share.settings import SUGGESTED_STARVED_BELOW, Handover, LoneHolder
    from tests.share.fakecuda import running_controller

    workloads = [w for w, _ in mix]
    if variant == "unmanaged":
        return run(fake, tmp, workloads, seconds), {}
    names = tenant_names(mix)
    handover, _, rule = variant.partition("-")
    policy = [TenantPolicy(n, share) for n, (_, share) in zip(names, mix, strict=True)]
    with running_controller(str(tmp / "ledger"), policy, handover=Handover(handover),
                            starved_below=SUGGESTED_STARVED_BELOW if rule == "starved" else 0.0,
                            lone_holder=LoneHolder.DUTY if rule == "lone" else LoneHolder.HOLD) as c:
        steps = run(fake, tmp, workloads, seconds, names)
    return steps, {"lends": c.stats.lends, "reclaims": c.stats.reclaims, "starved": dict(c.stats.starved),
                   "beside_s": {n: rnd(c.stats.state_s.get((n, "beside"), 0.0), 2) for n in names},
                   "duty_at_end": {names[s]: rnd(d, 3) for s, d in c.duty.items() if d < 1.0},
                   "lone_throughput_at_end": rnd(c.lone_throughput, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results file; with --plot, the picture")
    p.add_argument("--plot", metavar="JSON", help="draw a results file's first round instead of measuring: "
                   "each tenant's fraction under every variant, as bars")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--variants", default="unmanaged,drain,overlap",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--mixes", default=",".join(list(MIXES)[:3]),
                   help=f"comma-separated, of {', '.join(MIXES)}; or all")
    args = p.parse_args()
    if args.plot:
        from share_workloads_bench import plot_variants

        plot_variants(args.plot, args.out, "gpuscope share variants on the CPU host's fake GPU (round 0)")
        return
    variants = args.variants.split(",")
    mixes = list(MIXES) if args.mixes == "all" else args.mixes.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [m for m in mixes if m not in MIXES]
    if unknown:
        raise SystemExit(f"share_sim_bench: unknown variant or mix: {', '.join(unknown)}")

    tmp = Path(tempfile.mkdtemp())
    fake = build_fake(tmp)
    used = sorted({w for m in mixes for w, _ in MIXES[m]})
    alone = {w: run(fake, tmp, [w], args.seconds)[0] for w in used}
    log(f"alone: {alone}")
    out: dict = {"date": time.strftime("%Y-%m-%d"), "seconds": args.seconds, "rounds": args.rounds,
                 "host_cpus": os.cpu_count(), "alone": alone, "mixes": []}
    for name in mixes:
        mix = MIXES[name]
        entry: dict = {"name": name, "rounds": []}
        for rnd_i in range(args.rounds):
            got: dict = {}
            for variant in variants if rnd_i % 2 == 0 else variants[::-1]:
                steps, stats = run_variant(variant, fake, tmp, mix, args.seconds)
                fractions = [s / alone[w] for s, (w, _) in zip(steps, mix, strict=True)]
                got[variant] = {"tenants": [{"name": n, "workload": w, "share": share, "fraction": rnd(f)}
                                            for n, (w, share), f in
                                            zip(tenant_names(mix), mix, fractions, strict=True)],
                                "sum": rnd(sum(fractions)), **stats}
                log(f"{name} round {rnd_i} {variant}: {[rnd(f) for f in fractions]} sum {rnd(sum(fractions))}"
                    + (f" starved {stats['starved']}" if stats.get("starved") else ""))
            entry["rounds"].append(got)
        first = entry["rounds"][0]
        managed = next((v for v in variants if v != "unmanaged"), None)
        entry.update(first)
        if managed:
            entry.update(tenants=first[managed]["tenants"], sum_managed=first[managed]["sum"])
        if "unmanaged" in first:
            entry["sum_unmanaged"] = first["unmanaged"]["sum"]
        out["mixes"].append(entry)
        write_json(args.out, out, indent=1)
    for m in out["mixes"]:
        for rnd_i, got in enumerate(m["rounds"]):
            print(f"{m['name']:28s} round {rnd_i}: " + "; ".join(
                f"{v} {' / '.join(str(t['fraction']) for t in r['tenants'])} (sum {r['sum']})"
                for v, r in got.items()))


if __name__ == "__main__":
    main()
