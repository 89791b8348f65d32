"""`gpuscope share` as it is deployed: a policy file, tenants joined through injected environment,
and a policy change while they run.

The controller reads its tenants from a policy file (as from a Kubernetes ConfigMap) in a folder the
tenants mount; two matmul tenants start with exactly the environment the admission webhook injects
(LD_PRELOAD, GPUSCOPE_SHARE_TENANT, GPUSCOPE_SHARE_LEDGER). After a while the file is replaced (70/30
to 50/50, by rename, as a ConfigMap update does): how long until the controller applied it (its
/metrics), and until each tenant's throughput settled at the new share (0.5 s windows).

Usage (a GPU host, the preload library built):
    PYTHONPATH=src python benchmarks/share_deploy_bench.py --out X.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import logger, rnd, write_json  # noqa: E402
from share_bench import Controller, _lib, collect, rate, sleep_until  # noqa: E402
from share_memory_bench import metric  # noqa: E402

FOLDER = "/dev/shm/gpuscope-share-deploy"
LEDGER = f"{FOLDER}/ledger"
BEFORE = "tenants:\n  a: {share: 0.7}\n  b: {share: 0.3}\n"
AFTER = "tenants:\n  a: {share: 0.5}\n  b: {share: 0.5}\n"
#: Throughput windows: 0.5 s holds about 30 matmuls alone, so one matmul is 3.3 points of a share;
#: the settling time is judged on 1 s windows (two of them), to within 3 points.
WINDOW_S = 0.5
log = logger("share-deploy")


def write_policy(path: str, text: str) -> None:
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)


def spawn(seconds: float, start_at: float, tenant: str | None):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if tenant:  # what the admission webhook injects into a pod's containers
        env.update(LD_PRELOAD=_lib(), GPUSCOPE_SHARE_TENANT=tenant, GPUSCOPE_SHARE_LEDGER=LEDGER)
    argv = [sys.executable, os.path.join(HERE, "share_bench.py"), "worker", "hog", str(seconds),
            str(start_at)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def settled_after(series: list[dict], change: float, target: dict[str, float], points: float) -> float | None:
    """Seconds from ``change`` to the end of the first 1 s window (two consecutive ``WINDOW_S`` windows)
    from which every later one has each tenant within ``points`` of its target."""
    after = [w for w in series if w["t"] >= change]
    pairs = [{"t": a["t"], **{t: (a[t] + b[t]) / 2 for t in target}} for a, b in itertools.pairwise(after)]
    for i, w in enumerate(pairs):
        if all(all(abs(v[t] - target[t]) * 100 <= points for t in target) for v in pairs[i:]):
            return w["t"] + 2 * WINDOW_S - change
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=9493)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--change-at", type=float, default=20.0)
    args = p.parse_args()
    shutil.rmtree(FOLDER, ignore_errors=True)
    os.makedirs(FOLDER, mode=0o755)
    policy = f"{FOLDER}/policy.yaml"
    write_policy(policy, BEFORE)
    alone_run = collect(spawn(6.0, time.time() + 1, None))
    alone = rate(alone_run["stamps"], alone_run["stamps"][0], alone_run["stamps"][-1])
    log(f"alone: {alone:.1f} it/s")
    ctl = Controller("", "events", args.port, "--share.policy-file", policy, ledger=LEDGER)
    start = time.time() + 12
    procs = {t: spawn(args.seconds, start, t) for t in "ab"}
    sleep_until(start)
    ctl.mark()
    change = start + args.change_at
    sleep_until(change)
    write_policy(policy, AFTER)
    applied = None
    while time.time() < change + 5:
        if (metric(args.port, 'gpuscope_share_policy_reloads_total{result="applied"}') or 0) >= 1:
            applied = time.time() - change
            break
        time.sleep(0.02)
    results = {t: collect(pr) for t, pr in procs.items()}
    controller = ctl.stop()
    series = []
    t = start
    while t + WINDOW_S <= start + args.seconds:
        series.append({"t": t, **{n: rate(r["stamps"], t, t + WINDOW_S) / alone for n, r in results.items()}})
        t += WINDOW_S

    def mean(lo: float, hi: float, tenant: str) -> float:
        return rate(results[tenant]["stamps"], lo, hi) / alone

    out = {"date": time.strftime("%Y-%m-%d"), "alone_its_per_s": rnd(alone), "window_s": WINDOW_S,
           "before": {"target": {"a": 0.7, "b": 0.3},
                      "fraction": {n: rnd(mean(start + 2, change, n)) for n in "ab"}},
           "after": {"target": {"a": 0.5, "b": 0.5},
                     "fraction": {n: rnd(mean(change + 2, start + args.seconds, n)) for n in "ab"}},
           "applied_after_s": rnd(applied),
           "settled_within_3_points_after_s": rnd(settled_after(series, change, {"a": 0.5, "b": 0.5}, 3.0)),
           "series": [{k: rnd(v) for k, v in w.items()} for w in series],
           "hook_errors": {n: r["stats"]["hook_errors"] for n, r in results.items()},
           "controller": {k: v for k, v in controller.items() if k != "metrics"},
           "controller_metrics": [m for m in controller["metrics"] if "policy" in m or "target" in m]}
    write_json(args.out, out, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "series"}, indent=1))


if __name__ == "__main__":
    main()
