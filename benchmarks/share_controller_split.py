"""Where the share controller's CPU goes: its Python decisions, its turn keeper, its other threads
and a scrape, with tenants on the real-time fake GPU of ``share_controller_cpu.py``.

    PYTHONPATH=src python benchmarks/share_controller_split.py \
        --out benchmarks/results/share-controller-split.json

``share_controller_cpu.py`` reads the controller's CPU as a whole. This runs the same scenarios with the
controller started through this file, which wraps two of its methods before it starts:
``Controller.step`` (the Python decisions: charging, probes, the active set, a hand-over when the turn
keeper is not running) and ``Controller.keep_turns`` (building the keeper's arguments, then
``_turns.take_turns``, the C loop that hands turns over until its next return), each timed on its
thread's CPU clock. It also counts why a loop pass did not enter the keeper (no tenant holds a turn,
a probe under way, shares not binding, a gang) and the keeper's returns by reason. The controller
dumps its counts on SIGUSR1; two dumps ``--seconds`` apart, with no scrape between them, give the
rates. Then ``--scrapes`` scrapes of ``/metrics`` back to back give a scrape's CPU. Per thread of the
controller also its CPU and voluntary context switches over the same window (from /proc).

The wrappers add two clock reads a call (about 1 µs); everything else is the controller as shipped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import rnd, write_json  # noqa: E402
from share_bench import Controller, collect, sleep_until  # noqa: E402
from share_controller_cpu import LEDGER, SCENARIOS, build_fake_driver, spawn  # noqa: E402

from gpuscope.contract import catalogue as cat  # noqa: E402

DUMP_ENV = "SHARE_SPLIT_DUMP"


def run_controller() -> None:
    """The controller, its step and keeper calls timed (the ``controller`` subcommand)."""
    from gpuscope.cli import main as cli_main
    from gpuscope.share import controller as ctl_mod

    counts: dict = {"step_n": 0, "step_cpu_s": 0.0, "keep_n": 0, "keep_cpu_s": 0.0, "returns": {},
                    "not_kept": {}}
    cls, take_turns = ctl_mod.Controller, ctl_mod._turns.take_turns
    step, keep_turns, keeps_turns = cls.step, cls.keep_turns, cls.keeps_turns

    def timed_step(self):
        t = time.thread_time()
        try:
            return step(self)
        finally:
            counts["step_cpu_s"] += time.thread_time() - t
            counts["step_n"] += 1

    def timed_keep(self, seen):
        t = time.thread_time()
        try:
            return keep_turns(self, seen)
        finally:
            counts["keep_cpu_s"] += time.thread_time() - t
            counts["keep_n"] += 1

    def counted_keeps(self):
        kept = keeps_turns(self)
        if not kept:
            why = ("not binding" if not self.stats.binding else "no holder" if self.holder is None else
                   "probe" if self.prober.probe is not None else "gang" if self.gang_slots() else "no keeper")
            counts["not_kept"][why] = counts["not_kept"].get(why, 0) + 1
        return kept

    def counted_take_turns(**kwargs):
        out = take_turns(**kwargs)
        reason = {ctl_mod._turns.RETURN_DEADLINE: "deadline", ctl_mod._turns.RETURN_BELL: "bell",
                  ctl_mod._turns.RETURN_IDLE: "idle", ctl_mod._turns.RETURN_GONE: "gone"}[out["reason"]]
        counts["returns"][reason] = counts["returns"].get(reason, 0) + 1
        return out

    cls.step, cls.keep_turns, cls.keeps_turns = timed_step, timed_keep, counted_keeps
    ctl_mod._turns.take_turns = counted_take_turns
    dump_to = os.environ[DUMP_ENV]

    def dump(*_: object) -> None:
        with open(dump_to + ".tmp", "w") as f:
            json.dump(counts, f)
        os.replace(dump_to + ".tmp", dump_to)

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["gpuscope", *sys.argv[2:]]
    cli_main()


def threads(pid: int) -> dict[str, tuple[str, float, int]]:
    """Each thread of ``pid``: (name, CPU seconds, voluntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(base + "/comm") as f:
                name = f.read().strip()
            with open(base + "/schedstat") as f:
                cpu_s = int(f.read().split()[0]) / 1e9
            with open(base + "/status") as f:
                switches = next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt_switches"))
        except OSError:  # the thread ended meanwhile
            continue
        out[tid] = (name, cpu_s, switches)
    return out


def probes(lines: list[str]) -> float:
    """The controller's probes so far, from its ``/metrics`` lines."""
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(cat.SHARE_PROBES.name))


def one_round(scenario: str, seconds: float, scrapes: int, fake: str, port: int,
              settle_s: float = 2.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="share-split-") as private:  # the counts' file: ours alone
        counts_file = os.path.join(private, "counts")
        return measure_round(scenario, seconds, scrapes, fake, port, settle_s, counts_file)


def measure_round(scenario: str, seconds: float, scrapes: int, fake: str, port: int, settle_s: float,
                  dump_to: str) -> dict:
    shares, tenants = SCENARIOS[scenario]
    ctl = Controller(shares, "events", port, ledger=LEDGER, launcher=(sys.executable, __file__, "controller"),
                     env={DUMP_ENV: dump_to})

    def counts() -> dict:
        os.kill(ctl.p.pid, signal.SIGUSR1)
        deadline = time.time() + 5
        while not os.path.exists(dump_to) and time.time() < deadline:
            time.sleep(0.01)
        with open(dump_to) as f:
            got = json.load(f)
        os.unlink(dump_to)
        return got

    run_s = settle_s + seconds + 2.0
    start = time.time() + 1.0
    procs = [spawn(kind, name, run_s, start, fake) for kind, name in tenants]
    # past the tenants' first probes; the probes back off over the first half-minute (a steady
    # tenant's spacing doubles per agreeing probe up to --share.probe-backoff), so a long settle reads
    # the steady state and a short one the start
    sleep_until(start + settle_s)
    probes_a = (time.time(), probes(ctl.scrape()))  # scraped outside the window measured
    a, threads_a, cpu_a, t_a = counts(), threads(ctl.p.pid), ctl.cpu(), time.time()
    time.sleep(seconds)
    b, threads_b, cpu_b, t_b = counts(), threads(ctl.p.pid), ctl.cpu(), time.time()
    probes_b = (time.time(), probes(ctl.scrape()))
    wall = t_b - t_a
    cpu_before_scrapes = ctl.cpu()
    for _ in range(scrapes):
        ctl.scrape()
    scrape_ms = 1e3 * (ctl.cpu() - cpu_before_scrapes) / max(1, scrapes)
    for p in procs:
        collect(p)
    ctl.stop()

    def per_s(key: str) -> float:
        return rnd((b[key] - a[key]) / wall, 2)

    def by_name(key: str) -> dict:
        return {k: rnd((v - a[key].get(k, 0)) / wall, 2) for k, v in b[key].items()}

    step_n = b["step_n"] - a["step_n"]
    return {
        "scenario": scenario, "seconds": rnd(wall, 2), "settle_s": settle_s,
        "controller_cpu_pct": rnd(100 * (cpu_b - cpu_a) / wall, 3),
        "steps_per_s": per_s("step_n"),
        "step_cpu_pct": rnd(100 * (b["step_cpu_s"] - a["step_cpu_s"]) / wall, 3),
        "step_cpu_us": rnd(1e6 * (b["step_cpu_s"] - a["step_cpu_s"]) / max(1, step_n), 1),
        "keeper_calls_per_s": per_s("keep_n"),
        "keeper_cpu_pct": rnd(100 * (b["keep_cpu_s"] - a["keep_cpu_s"]) / wall, 3),
        "keeper_returns_per_s": by_name("returns"), "not_kept_per_s": by_name("not_kept"),
        "threads": {tid: {"name": name, "cpu_pct": rnd(100 * (cpu - threads_a[tid][1]) / wall, 3),
                          "wakeups_per_s": rnd((sw - threads_a[tid][2]) / wall, 1)}
                    for tid, (name, cpu, sw) in threads_b.items() if tid in threads_a},
        "probes_per_s": rnd((probes_b[1] - probes_a[1]) / (probes_b[0] - probes_a[0]), 2),
        "scrape_cpu_ms": rnd(scrape_ms, 2),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "controller":
        run_controller()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scrapes", type=int, default=20)
    p.add_argument("--settle-s", type=float, default=2.0, help="seconds after the tenants start before "
                   "measuring")
    p.add_argument("--scenarios", default="graph-spread")
    p.add_argument("--port", type=int, default=9418)
    args = p.parse_args()
    unknown = [s for s in args.scenarios.split(",") if s not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: {', '.join(map(repr, unknown))} not one of {', '.join(SCENARIOS)}")
    rows = []
    with tempfile.TemporaryDirectory() as fake:
        build_fake_driver(fake)
        for round_ in range(args.rounds):
            for scenario in args.scenarios.split(","):
                row = one_round(scenario, args.seconds, args.scrapes, fake, args.port, args.settle_s)
                row["round"] = round_
                rows.append(row)
                print(f"round {round_} {scenario}: controller {row['controller_cpu_pct']:.2f}% = Python "
                      f"decisions {row['step_cpu_pct']:.2f}% ({row['steps_per_s']:.1f}/s, "
                      f"{row['step_cpu_us']:.0f} µs each) + keeper calls {row['keeper_cpu_pct']:.2f}% "
                      f"({row['keeper_calls_per_s']:.1f}/s) + the rest; not kept {row['not_kept_per_s']}; "
                      f"probes {row['probes_per_s']:.2f}/s; "
                      f"a scrape {row['scrape_cpu_ms']:.1f} ms", flush=True)
                write_json(args.out, {"what": "the share controller's CPU split into its Python decisions, "
                                              "its turn keeper's calls and its other threads, fake GPU",
                                      "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                                      "host": os.uname().nodename, "cpus": os.cpu_count(), "rows": rows},
                           indent=1)


if __name__ == "__main__":
    main()
