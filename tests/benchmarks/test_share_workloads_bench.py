"""benchmarks/share_workloads_bench.py: the plot of a results file in the shape the script writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "share_workloads_bench.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def draw(src: Path, out: Path, *flags: str) -> None:
    """The script's --plot of ``src`` into ``out``, which must come out a PNG."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--plot", str(src), *flags, "--plot-out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)


def tenant(name: str, share: float, timeline: list[float]) -> dict:
    return {"name": name, "workload": name.split("-")[1], "share": share,
            "fraction": sum(timeline) / len(timeline), "worst_window_pts": 1.0,
            "worst_window_below_share_pts": 0.0, "timeline": timeline}


def mix(name: str, managed: list[dict], plain: list[dict]) -> dict:
    run = {"tenants": managed, "sum": 1.3, "cpu_core_pct": 0.4}
    return {"name": name, "unmanaged": {"tenants": plain, "sum": 1.4, "cpu_core_pct": None}, "drain": run,
            "overlap": run, "tenants": managed, "sum_managed": 1.3, "sum_unmanaged": 1.4, "cpu_core_pct": 0.4}


def test_each_mix_is_drawn_managed_beside_unmanaged(tmp_path: Path) -> None:
    results = {"date": "2026-12-03", "seconds": 4, "alone": {}, "latency": [], "mixes": [
        mix("train+encoder 70/30", [tenant("t0-train", 0.7, [0.8, 0.85, 0.9, 0.86]),
                                    tenant("t1-encoder", 0.3, [0.5, 0.45, 0.4, 0.44])],
            [tenant("t0-train", 0.7, [0.7] * 4), tenant("t1-encoder", 0.3, [0.7] * 4)]),
        mix("a+b+c", [tenant(f"t{i}-x", s, [s] * 4) for i, s in enumerate((0.5, 0.3, 0.2))],
            [tenant(f"t{i}-x", s, [0.4] * 4) for i, s in enumerate((0.5, 0.3, 0.2))]),
    ]}
    src, out = tmp_path / "results.json", tmp_path / "mixes.png"
    src.write_text(json.dumps(results))
    draw(src, out)


def test_the_variants_of_a_run_are_drawn_side_by_side(tmp_path: Path) -> None:
    results = {"date": "2026-12-06", "seconds": 4, "alone": {}, "latency": [], "mixes": [
        mix("train+encoder 70/30", [tenant("t0-train", 0.7, [0.8] * 4), tenant("t1-encoder", 0.3, [0.4] * 4)],
            [tenant("t0-train", 0.7, [0.7] * 4), tenant("t1-encoder", 0.3, [0.7] * 4)])]}
    results["mixes"][0]["drain-short-queue"] = results["mixes"][0]["drain"]  # a variant named by its run
    src, out = tmp_path / "results.json", tmp_path / "variants.png"
    src.write_text(json.dumps(results))
    draw(src, out, "--plot-variants")


def test_measuring_needs_an_output_file() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--out is required" in done.stderr


def test_an_unknown_latency_variant_is_refused_before_anything_runs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.json"),
                           "--latency-variants", "drain-everything"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--latency-variants" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_each_workload_is_measured_alone_again_after_the_mixes(tmp_path: Path, monkeypatch) -> None:
    """The fractions are against the alone rates at the start; the second measurement after the mixes
    says how far the host drifted. Processes and mixes are stubbed (they need a GPU): each alone run
    yields 100 steps a second at the start and 80 after the mixes."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import share_workloads_bench as bench

    measured = {"rounds": 0}

    class Proc:
        def __init__(self, workload: str) -> None:
            self.workload, self.start = workload, 0.0

    def release(procs: list, offsets: list[float] | None = None, lead_s: float = 0.5) -> float:
        measured["rounds"] += 1
        for proc, offset in zip(procs, offsets or [0.0] * len(procs), strict=True):
            proc.start, proc.steps_per_s = 1000.0 + offset, 100 if measured["rounds"] == 1 else 80
        return 1000.0

    def collect(proc: Proc) -> list[float]:
        return [proc.start + k / proc.steps_per_s for k in range(int(proc.steps_per_s * 2))]

    def run_mix(tenants: tuple, variant: str, seconds: float, alone: dict, port: int) -> dict:
        rows = [tenant(f"t{i}-{w}", s, [0.5]) for i, (w, s) in enumerate(tenants)]
        return {"tenants": rows, "sum": 1.0, "cpu_core_pct": 0.1}

    monkeypatch.setattr(bench, "spawn", lambda w, seconds, tenant_name, role="worker": Proc(w))
    monkeypatch.setattr(bench, "release", release)
    monkeypatch.setattr(bench, "collect", collect)
    monkeypatch.setattr(bench, "run_mix", run_mix)
    out = tmp_path / "results.json"
    monkeypatch.setattr(sys, "argv", ["x", "--out", str(out), "--alone-seconds", "1", "--mixes",
                                      "train+encoder 70/30", "--variants", "unmanaged,drain", "--hogs", ""])
    bench.main()
    results = json.loads(out.read_text())
    assert results["alone"] == {"encoder": 100.0, "train": 100.0}
    assert results["alone_after_mixes"] == {"encoder": 80.0, "train": 80.0}
    assert results["alone_drift"] == {"encoder": 0.8, "train": 0.8}


def test_the_helpers_wake_ups_are_read_by_reason_from_two_scrapes(monkeypatch) -> None:
    """Each tenant's helper wake-ups a second by reason, its processes summed, from the controller's
    series as prometheus_client writes them (the catalogue's family)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import share_bench
    from prometheus_client import CollectorRegistry, generate_latest

    from gpuscope.contract import catalogue as cat

    def scrape(counts: dict[tuple[str, str, str], float]) -> list[str]:
        class Collector:
            def collect(self):
                family = cat.SHARE_HELPER_WAKEUPS.family()
                for (tenant, pid, reason), value in counts.items():
                    family.add_metric([tenant, pid, reason, "0", "GPU-1"], value)
                yield family

        registry = CollectorRegistry()
        registry.register(Collector())
        text = generate_latest(registry).decode()
        return [ln for ln in text.splitlines() if ln.startswith("gpuscope_share_")]

    first = scrape({("t0-train", "11", "nap"): 10, ("t0-train", "12", "nap"): 5,
                    ("t1-encoder", "13", "gate"): 0})
    second = scrape({("t0-train", "11", "nap"): 30, ("t0-train", "12", "nap"): 25,
                     ("t1-encoder", "13", "gate"): 8})
    rates = share_bench.helper_wakeups_per_s((100.0, first), (102.0, second))
    assert rates == {"t0-train": {"nap": 20.0}, "t1-encoder": {"gate": 4.0}}


def test_latency_rounds_each_have_their_alone_run_and_the_row_holds_the_medians(tmp_path: Path,
                                                                                monkeypatch) -> None:
    """Processes are stubbed (they need a GPU): each call of run_latency is logged, and its p99 reads
    from a list, so the ratios each round and their medians are known."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import share_workloads_bench as bench

    calls = []
    # per round: alone, then unmanaged and managed (flipped in the second round), then drain-hold
    p99s = iter([2.0, 3.0, 2.4, 2.2,  # round 1: alone, unmanaged, managed, variant
                 4.0, 4.4, 6.0, 4.8,  # round 2: alone, managed, unmanaged, variant
                 2.0, 3.2, 2.2, 2.0])  # round 3

    def run_latency(hog, flags, seconds, rate, alone, port):
        calls.append((hog, flags))
        return {"p99_ms": next(p99s), "p50_ms": 1.0, "hog_fraction": 0.8 if hog else None,
                "cpu_core_pct": 0.2 if flags else None, "controller_metrics": [], "controller_mid_run": []}

    monkeypatch.setattr(bench, "run_latency", run_latency)
    monkeypatch.setattr(bench, "measure_alone", lambda workloads, seconds: {w: 100.0 for w in workloads})
    out = tmp_path / "results.json"
    monkeypatch.setattr(sys, "argv", ["x", "--out", str(out), "--mixes", "", "--hogs", "train",
                                      "--latency-rounds", "3", "--latency-variants", "drain-hold"])
    bench.main()
    managed, plain, hold = bench.VARIANTS["drain"], bench.VARIANTS["unmanaged"], bench.VARIANTS["drain-hold"]
    assert calls == [(None, plain), ("train", plain), ("train", managed), ("train", hold),
                     (None, plain), ("train", managed), ("train", plain), ("train", hold),
                     (None, plain), ("train", plain), ("train", managed), ("train", hold)]
    row = json.loads(out.read_text())["latency"][0]
    assert [r["p99_vs_alone_managed"] for r in row["rounds"]] == [1.2, 1.1, 1.1]
    assert [r["p99_vs_alone_unmanaged"] for r in row["rounds"]] == [1.5, 1.5, 1.6]
    assert row["p99_vs_alone_managed"] == 1.1 and row["p99_vs_alone_unmanaged"] == 1.5
    assert row["drain-hold"]["p99_vs_alone"] == 1.1  # 1.1, 1.2, 1.0
    assert "controller_metrics" not in row["rounds"][0] and "controller_metrics" in row


def test_the_latency_tenant_is_drawn_beside_each_hog(tmp_path: Path) -> None:
    row = {"hog": "train", "rate_per_s": 150.0, "p99_alone_ms": 4.0, "p99_vs_alone_managed": 1.1,
           "p99_vs_alone_unmanaged": 1.4, "hog_fraction_managed": 0.85, "hog_fraction_unmanaged": 0.9,
           "p50_ms_managed": 3.0, "p50_ms_unmanaged": 3.2, "p50_alone_ms": 2.5,
           "drain-hold": {"p99_vs_alone": 1.0, "p50_ms": 2.8, "hog_fraction": 0.7}}
    results = {"date": "2026-12-07", "seconds": 4, "alone": {}, "mixes": [],
               "latency": [row, {**row, "hog": "encoder"}]}
    src, out = tmp_path / "results.json", tmp_path / "latency.png"
    src.write_text(json.dumps(results))
    draw(src, out, "--plot-latency")
