#!/usr/bin/env python3
"""Scrape cost against the GPU count: the exporter's cached exposition vs rendering per scrape.

Runs the exporter in this process on the project's fake NVML (``tests/nvml/fake_nvml.py``, which
answers with pynvml's own structures) with 1, 2, 8, 16 and 64 GPUs, every default collector plus
``processes`` (4 processes per GPU), behind its real HTTP server on 127.0.0.1. For each GPU count
two servers share one exporter:

- ``cached``: what ``gpuscope exporter`` serves, bytes rendered in the background after each
  sampling round, plus the few series read at scrape time (staleness, process metrics);
- ``render per scrape``: the same registry rendered by prometheus_client on every scrape (what
  the exporter did before, and what most Python exporters do).

Scrapes go over one keep-alive connection with Prometheus's own ``Accept`` header (OpenMetrics),
in interleaved rounds (cached, per-scrape, cached, ...), so both see the same machine load.
Also reports the background renderer's CPU per second (its cost moved off the scrape path). The
process hands the GIL over as ``gpuscope exporter`` does (``--switch-interval`` to compare).
Absolute times depend on the machine; the shape (flat vs growing with GPUs) is the result.

    python benchmarks/scrape_bench.py --out benchmarks/results/scrape-h200-host.json
    python benchmarks/scrape_bench.py --gpus 1,64 --rounds 2 --scrapes 20 --out /tmp/scrape.json  # quick
    python benchmarks/scrape_bench.py --replot benchmarks/results/scrape-h200-host.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from benchlib import logger, percentile, utc_now, write_json  # noqa: E402
from prometheus_client.exposition import choose_encoder  # noqa: E402

from gpuscope.nvml.config import COLLECTORS, Config  # noqa: E402
from gpuscope.nvml.exporter import Exporter  # noqa: E402
from gpuscope.nvml.http import ExporterServer  # noqa: E402
from gpuscope.nvml.main import GIL_SWITCH_INTERVAL_S  # noqa: E402
from tests.nvml.fake_nvml import FakeGpu, FakeNvml, FakeProcess  # noqa: E402

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TARGET_P99_MS = 1.0
log = logger("scrape_bench")


def fake_host(gpus: int) -> FakeNvml:
    pid = os.getpid()
    return FakeNvml([FakeGpu(processes=[FakeProcess(pid + k, (k + 1) << 30) for k in range(4)],
                             proc_samples=[(pid + k, 5, 10 * k) for k in range(4)])
                     for _ in range(gpus)])


def scrape(conn: http.client.HTTPConnection) -> tuple[float, int]:
    start = time.perf_counter()
    conn.request("GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    body = conn.getresponse().read()
    return time.perf_counter() - start, len(body)


def measure(gpus: int, rounds: int, scrapes: int) -> dict:
    collectors = frozenset(n for n, (on, _) in COLLECTORS.items() if on) | {"processes"}
    exporter = Exporter(Config(interval=1.0, slow_interval=10.0, collectors=collectors), nv=fake_host(gpus),
                        proc_root="/nonexistent").start()

    def render_per_scrape(accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(exporter.registry), content_type

    servers = {"cached": ExporterServer(("127.0.0.1", 0), exporter.metrics, exporter.healthz),
               "render_per_scrape": ExporterServer(("127.0.0.1", 0), render_per_scrape, exporter.healthz)}
    try:
        deadline = time.monotonic() + 30
        while not all(state.last_success for state in exporter.store.snapshot().values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the exporter's first sampling rounds did not finish within 30 s")
            time.sleep(0.05)
        for server in servers.values():
            server.serve_in_thread()
        conns = {name: http.client.HTTPConnection("127.0.0.1", s.server_address[1], timeout=10)
                 for name, s in servers.items()}
        times: dict[str, list[float]] = {name: [] for name in servers}
        sizes: dict[str, int] = {}
        for name, conn in conns.items():  # warm-up: first render of the negotiated format, connections
            for _ in range(3):
                _, sizes[name] = scrape(conn)
        render_cpu0, renders0 = exporter_render_cpu(exporter), exporter.exposition.renders
        wall0 = time.monotonic()
        for _ in range(rounds):
            for name, conn in conns.items():
                for _ in range(scrapes):
                    elapsed, _ = scrape(conn)
                    times[name].append(elapsed)
                    time.sleep(0.002)  # Prometheus scrapes are spread out, not back to back
        wall = time.monotonic() - wall0
        renders = exporter.exposition.renders - renders0
        render_cpu = exporter_render_cpu(exporter) - render_cpu0
        for conn in conns.values():
            conn.close()
    finally:
        for server in servers.values():
            server.shutdown()
            server.server_close()
        exporter.stop()
    result = {"gpus": gpus, "series_bytes": sizes}
    for name, values in times.items():
        result[name] = {"p50_ms": round(statistics.median(values) * 1e3, 3),
                        "p99_ms": round(percentile(values, 99) * 1e3, 3),
                        "max_ms": round(max(values) * 1e3, 3), "scrapes": len(values)}
    result["background_renders_per_s"] = round(renders / wall, 2)
    result["background_render_cpu_pct_of_one_core"] = None if render_cpu is None else round(
        100 * render_cpu / wall, 3)
    return result


def exporter_render_cpu(exporter: Exporter) -> float | None:
    """CPU seconds of the renderer thread so far (Linux: /proc/self/task/<tid>/stat)."""
    tid = exporter.exposition._thread.native_id
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plot(report: dict, path: Path) -> None:
    """Scrape latency against GPU count, cached vs rendered per scrape (log scales), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    gpus = [r["gpus"] for r in report["results"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, color in (("cached", "served from the background rendering", "tab:blue"),
                              ("render_per_scrape", "rendered per scrape", "tab:red")):
        ax.plot(gpus, [r[key]["p50_ms"] for r in report["results"]], "o-", color=color, label=f"{label}, p50")
        ax.plot(gpus, [r[key]["p99_ms"] for r in report["results"]], "o--", color=color, alpha=0.6,
                label=f"{label}, p99")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.set_xlabel("GPUs (fake NVML, every default collector + processes)")
    ax.set_ylabel("scrape latency, ms")
    ax.set_title(f"gpuscope exporter /metrics ({report['machine']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="1,2,8,16,64", help="comma-separated GPU counts")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds per GPU count")
    p.add_argument("--scrapes", type=int, default=50, help="scrapes per server per round")
    p.add_argument("--switch-interval", type=float, default=GIL_SWITCH_INTERVAL_S,
                   help=f"sys.setswitchinterval for the run (gpuscope exporter's: {GIL_SWITCH_INTERVAL_S})")
    p.add_argument("--out", help="JSON path, the plot beside it (.png); required unless --replot")
    p.add_argument("--replot", metavar="JSON", help="only draw the plot of an earlier run's JSON")
    args = p.parse_args(argv)
    if not args.replot and not args.out:
        p.error("--out is required (benchmarks/README.md lists the current results)")
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    sys.setswitchinterval(args.switch_interval)
    results = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        log(f"{gpus} fake GPU(s): {args.rounds} rounds x {args.scrapes} scrapes per server")
        results.append(measure(gpus, args.rounds, args.scrapes))
        r = results[-1]
        log(f"  cached p99 {r['cached']['p99_ms']} ms, "
            f"render per scrape p99 {r['render_per_scrape']['p99_ms']} ms")
    first, last = results[0], results[-1]
    report = {
        "what": "scrape latency vs GPU count, exporter on the fake NVML in-process, HTTP on 127.0.0.1",
        "date": utc_now(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), Python {platform.python_version()}",
        "accept": PROMETHEUS_ACCEPT, "rounds": args.rounds, "scrapes_per_round": args.scrapes,
        "gil_switch_interval_s": args.switch_interval,
        "results": results,
        "cached_p99_growth_first_to_last": round(last["cached"]["p99_ms"] / first["cached"]["p99_ms"], 2),
        "render_per_scrape_p99_growth_first_to_last":
            round(last["render_per_scrape"]["p99_ms"] / first["render_per_scrape"]["p99_ms"], 2),
        "target_p99_ms": TARGET_P99_MS,
        "cached_meets_target_at_every_count": all(r["cached"]["p99_ms"] <= TARGET_P99_MS for r in results),
    }
    out = write_json(args.out, report)
    plot(report, out.with_suffix(".png"))
    print(f"{'GPUs':>5}  {'bytes':>8}  {'cached p50/p99 ms':>18}  {'per-scrape p50/p99 ms':>22}  "
          "renderer CPU %")
    for r in results:
        c, s = r["cached"], r["render_per_scrape"]
        print(f"{r['gpus']:>5}  {r['series_bytes']['cached']:>8}  {c['p50_ms']:>8.3f} / {c['p99_ms']:<7.3f}  "
              f"{s['p50_ms']:>10.3f} / {s['p99_ms']:<9.3f}  {r['background_render_cpu_pct_of_one_core']}")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
