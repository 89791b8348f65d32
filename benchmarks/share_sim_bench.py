"""`gpuscope share` on the fake driver's shared GPU: tenants with host gaps beside GPU-bound ones, on a
machine without a GPU (the CPU stand-in for share_workloads_bench.py, for the scheduling rules only).

The fake libcuda (tests/share/fake_libcuda.c, built here with gcc) runs every process's kernels one
after another on one wall clock shared through a file (FAKE_CUDA_REALTIME, FAKE_CUDA_SHARED_GPU), so
tenants contend for it as for a GPU; tests/share/workload.py is the tenant: ``steps`` (a burst of
kernels, a stream synchronize, host work: a training step) or ``busy`` (GPU-bound, a bounded queue).
Each mix runs alone, unmanaged, then managed with draining and with overlapping hand-overs (the turn
keeper in C), one after the other; per tenant its fraction of its alone rate, per mix the sums.

What it cannot show: the GPU's own time-slicing between contexts, launch costs of real drivers, and
anything about real workloads' kernels. Figures depend on the host's load (two cores, loaded, move
them by several points).

Usage:
    PYTHONPATH=src python benchmarks/share_sim_bench.py --out benchmarks/results/share-sim-cpu.json
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
MIXES = {
    "steps+busy 70/30": (("steps", 0.7), ("busy", 0.3)),
    "busy+busy 70/30": (("busy", 0.7), ("busy", 0.3)),
    "steps+busy+steps 50/30/20": (("steps", 0.5), ("busy", 0.3), ("steps", 0.2)),
}
WORKLOAD = ROOT / "tests" / "share" / "workload.py"


def build_fake(into: Path) -> Path:
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(into / "libcuda.so.1"),
                    str(ROOT / "tests" / "share" / "fake_libcuda.c")], check=True)
    return into


def run(fake: Path, tmp: Path, kinds: list[str], seconds: float,
        tenants: list[str] | None = None) -> list[int]:
    from tests.share.fakecuda import child_env

    gpu = tmp / f"gpu-{time.monotonic_ns()}"
    procs = []
    for i, kind in enumerate(kinds):
        env = child_env(fake, Path(os.devnull), tenant=tenants[i] if tenants else None,
                        ledger=str(tmp / "ledger") if tenants else None)
        env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_SHARED_GPU=str(gpu))
        procs.append(subprocess.Popen([sys.executable, str(WORKLOAD), kind, str(seconds)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    return [json.loads(p.communicate(timeout=120)[0])["steps"] for p in procs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    from gpuscope.share.ledger import TenantPolicy
    from gpuscope.share.settings import Handover
    from tests.share.fakecuda import running_controller

    tmp = Path(tempfile.mkdtemp())
    fake = build_fake(tmp)
    alone = {kind: run(fake, tmp, [kind], args.seconds)[0] for kind in ("steps", "busy")}
    log(f"alone: {alone}")
    out: dict = {"date": time.strftime("%Y-%m-%d"), "seconds": args.seconds, "alone": alone, "mixes": []}
    for name, mix in MIXES.items():
        kinds = [k for k, _ in mix]
        names = [f"t{i}-{k}" for i, k in enumerate(kinds)]
        entry: dict = {"name": name}
        plain = run(fake, tmp, kinds, args.seconds)
        variants = {"unmanaged": ([s / alone[k] for s, k in zip(plain, kinds, strict=True)], None)}
        for handover in (Handover.DRAIN, Handover.OVERLAP):
            policy = [TenantPolicy(n, share) for n, (_, share) in zip(names, mix, strict=True)]
            with running_controller(str(tmp / "ledger"), policy, handover=handover) as c:
                steps = run(fake, tmp, kinds, args.seconds, names)
            variants[str(handover)] = ([s / alone[k] for s, k in zip(steps, kinds, strict=True)],
                                  {"lends": c.stats.lends, "reclaims": c.stats.reclaims})
        for variant, (fractions, stats) in variants.items():
            entry[variant] = {"tenants": [{"name": n, "workload": k, "share": share, "fraction": rnd(f)}
                                          for n, (k, share), f in zip(names, mix, fractions, strict=True)],
                              "sum": rnd(sum(fractions)), **(stats or {})}
            log(f"{name} {variant}: {[rnd(f) for f in fractions]} sum {rnd(sum(fractions))}")
        entry.update(tenants=entry["drain"]["tenants"], sum_managed=entry["drain"]["sum"],
                     sum_unmanaged=entry["unmanaged"]["sum"])
        out["mixes"].append(entry)
        write_json(args.out, out, indent=1)
    print(json.dumps([{k: m[k] for k in ("name", "sum_managed", "sum_unmanaged")} | {
        "fractions": [t["fraction"] for t in m["tenants"]]} for m in out["mixes"]], indent=1))


if __name__ == "__main__":
    main()
