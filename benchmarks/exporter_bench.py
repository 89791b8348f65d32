#!/usr/bin/env python3
"""Exporter cost on a real GPU host: scrape latency, CPU share, and nvidia-smi as the peer approach.

Runs ``gpuscope exporter`` as a subprocess on real NVML (default settings, 1 s sampling), then:

1. scrape phase: ``--scrapes`` scrapes of /metrics spread over ``--scrape-window`` seconds on one
   keep-alive connection (as Prometheus does), interleaved with ``nvidia-smi --query-gpu``
   subprocess runs (what nvidia_gpu_exporter does per scrape) every ``--smi-every`` scrapes;
2. idle phase: the exporter's CPU time over ``--cpu-window`` seconds of background sampling with
   one scrape every 15 s (Prometheus's usual interval), read from /proc/<pid>/stat.

Needs only the standard library, pynvml and prometheus_client (gpuscope is imported from
``src/`` by path). Without a GPU it still runs and reports zero devices. Writes
``--out`` (required: benchmarks/README.md lists the current results, one per set of exporter flags)
and prints a table last. About 75 s with defaults.

    python benchmarks/exporter_bench.py --out benchmarks/results/exporter-h200-live-template.json   # GPU host
    python benchmarks/exporter_bench.py --scrapes 20 --scrape-window 2 --cpu-window 2 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from benchlib import logger, percentile, utc_now, write_json  # noqa: E402

from gpuscope.ops import procs  # noqa: E402
from gpuscope.util.freeport import free_port  # noqa: E402

SMI_QUERY = ("timestamp,name,pci.bus_id,driver_version,pstate,temperature.gpu,utilization.gpu,"
             "utilization.memory,memory.total,memory.free,memory.used,power.draw,clocks.sm,clocks.mem")
TARGETS = {"scrape_p99_ms": 5.0, "exporter_cpu_pct": 1.0}
TICKS = os.sysconf("SC_CLK_TCK")


log = logger("exporter_bench")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Scraper:
    """GET /metrics on one keep-alive connection, reconnecting if the server closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def scrape(self) -> tuple[float, bytes]:
        start = time.perf_counter()
        try:
            self.conn.request("GET", "/metrics")
            body = self.conn.getresponse().read()
        except (http.client.HTTPException, OSError):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            start = time.perf_counter()
            self.conn.request("GET", "/metrics")
            body = self.conn.getresponse().read()
        return time.perf_counter() - start, body


def sample_value(body: bytes, name: str) -> float | None:
    match = re.search(rb"^" + re.escape(name.encode()) + rb"(?:\{[^}]*\})? (\S+)$", body, re.M)
    return float(match.group(1)) if match else None


def start_exporter(port: int, interval: str, extra: list[str]) -> procs.Child:
    """``gpuscope exporter`` from this checkout on 127.0.0.1:``port``; ``wait_ready()`` waits for it."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from gpuscope.nvml.main import main; "
            "raise SystemExit(main(sys.argv[2:]))")
    argv = [sys.executable, "-c", code, str(ROOT / "src"), f"--web.listen-address=127.0.0.1:{port}",
            f"--sampling.interval={interval}", *extra]

    def ready() -> bytes | None:
        """The exposition once the exporter answers and its fast collector (if any GPU) has finished
        a round."""
        _, body = Scraper(port).scrape()
        gpus = sample_value(body, "gpuscope_exporter_gpus") or 0
        last_round = 'gpuscope_exporter_last_success_timestamp_seconds{collector="device"}'
        return body if gpus == 0 or sample_value(body, last_round) else None

    return procs.Child(argv, name="exporter", ready=ready).start()


def wait_ready(exporter: procs.Child, timeout: float = 60.0) -> bytes:
    """The exporter's first complete exposition; exits with its last output lines if it fails."""
    try:
        return exporter.wait_ready(timeout, interval_s=0.1)
    except procs.ChildError as exc:
        raise SystemExit(str(exc)) from None


def time_smi() -> float | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    start = time.perf_counter()
    result = subprocess.run([smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
                            capture_output=True, timeout=30)
    elapsed = time.perf_counter() - start
    return elapsed if result.returncode == 0 else None


def gpu_name(body: bytes) -> str:
    match = re.search(rb'^gpuscope_gpu_info\{[^}]*name="([^"]*)"', body, re.M)
    return match.group(1).decode() if match else "none"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scrapes", type=int, default=300)
    p.add_argument("--scrape-window", type=float, default=30.0, help="seconds the scrapes are spread over")
    p.add_argument("--smi-every", type=int, default=10, help="one nvidia-smi query per N scrapes")
    p.add_argument("--cpu-window", type=float, default=30.0, help="seconds of idle-phase CPU measurement")
    p.add_argument("--interval", default="1s", help="exporter --sampling.interval")
    p.add_argument("--exporter-arg", action="append", default=[], help="extra exporter flag (repeatable)")
    p.add_argument("--out", required=True, help="JSON path")
    args = p.parse_args(argv)

    port = free_port()
    log(f"starting exporter on 127.0.0.1:{port} (interval {args.interval})")
    proc = start_exporter(port, args.interval, args.exporter_arg)
    try:
        body = wait_ready(proc)
        gpus = int(sample_value(body, "gpuscope_exporter_gpus") or 0)
        log(f"ready: {gpus} GPU(s), {len(body)} bytes per scrape")

        scraper, scrape_s, smi_s = Scraper(port), [], []
        spacing = args.scrape_window / max(1, args.scrapes)
        cpu0, wall0 = cpu_seconds(proc.pid), time.monotonic()
        next_at = time.monotonic()
        for i in range(args.scrapes):
            elapsed, body = scraper.scrape()
            scrape_s.append(elapsed)
            if args.smi_every and i % args.smi_every == 0:
                smi = time_smi()
                if smi is not None:
                    smi_s.append(smi)
            if (i + 1) % max(1, args.scrapes // 5) == 0:
                p50 = statistics.median(scrape_s) * 1e3
                log(f"scrape phase {i + 1}/{args.scrapes}: p50 so far {p50:.2f} ms")
            next_at += spacing
            time.sleep(max(0.0, next_at - time.monotonic()))
        loaded_cpu_pct = 100 * (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - wall0)

        log(f"idle phase: {args.cpu_window:.0f}s of background sampling, a scrape every 15 s")
        cpu1, wall1, last_scrape = cpu_seconds(proc.pid), time.monotonic(), 0.0
        while (now := time.monotonic()) - wall1 < args.cpu_window:
            if now - last_scrape >= 15.0:
                scraper.scrape()
                last_scrape = now
            time.sleep(min(1.0, max(0.0, args.cpu_window - (time.monotonic() - wall1))))
        idle_cpu_pct = 100 * (cpu_seconds(proc.pid) - cpu1) / (time.monotonic() - wall1)
        _, body = scraper.scrape()
    finally:
        proc.stop(grace_s=10)
        err = proc.output()

    result = {
        "gpu": gpu_name(body),
        "date": utc_now(),
        "gpus": gpus,
        "scrape_p50_ms": round(statistics.median(scrape_s) * 1e3, 3),
        "scrape_p99_ms": round(percentile(scrape_s, 99) * 1e3, 3),
        "scrape_max_ms": round(max(scrape_s) * 1e3, 3),
        "scrapes": len(scrape_s),
        "nvidia_smi_query_ms": round(statistics.median(smi_s) * 1e3, 3) if smi_s else None,
        "nvidia_smi_query_p99_ms": round(percentile(smi_s, 99) * 1e3, 3) if smi_s else None,
        "nvidia_smi_queries": len(smi_s),
        "exporter_cpu_pct": round(idle_cpu_pct, 3),
        "exporter_cpu_pct_while_scraped_10_per_s": round(loaded_cpu_pct, 3),
        "exposition_bytes": len(body),
        "series": sum(1 for line in body.splitlines() if line and not line.startswith(b"#")),
        "sampling_interval": args.interval,
        "cpu_window_s": args.cpu_window,
        "exporter_stderr_lines": len(err.splitlines()) if err else 0,
        "targets": TARGETS,
        "meets_targets": (percentile(scrape_s, 99) * 1e3 <= TARGETS["scrape_p99_ms"]
                          and idle_cpu_pct <= TARGETS["exporter_cpu_pct"]),
    }
    out = write_json(args.out, result)
    smi = result["nvidia_smi_query_ms"]
    rows = [
        ("GPU", f"{result['gpu']} ({gpus} device(s))"),
        ("scrape p50 / p99 / max", f"{result['scrape_p50_ms']:.3f} / {result['scrape_p99_ms']:.3f} / "
                                   f"{result['scrape_max_ms']:.3f} ms  (target p99 ≤ 5 ms)"),
        ("nvidia-smi --query-gpu (median)", f"{smi:.1f} ms" if smi is not None else "n/a (no nvidia-smi)"),
        ("exporter CPU, 1 scrape/15 s", f"{idle_cpu_pct:.3f} % of one core  (target ≤ 1 %)"),
        ("exporter CPU, 10 scrapes/s", f"{loaded_cpu_pct:.3f} % of one core"),
        ("exposition", f"{result['series']} series, {result['exposition_bytes']} bytes"),
        ("written", str(out)),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
