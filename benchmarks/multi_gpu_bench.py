#!/usr/bin/env python3
"""On a host with two or more GPUs: exporter, timer and reference server across devices.

Four parts, each a JSON section; a part that fails records ``{"error": ...}`` and the others still run,
and a part that cannot run here says ``{"skipped": reason}``:

1. ``exporter``: ``gpuscope exporter --collector.processes`` as a subprocess, plus a child process that
   holds ``--child-mib`` on cuda:0 and cuda:1. Checks the GPU set and per-GPU memory.used against
   ``nvidia-smi``, scrape latency over ``--scrapes`` scrapes on one keep-alive connection (p99 ≤ 5 ms
   with every GPU sampled), and that the child's pid is attributed to both GPUs.
2. ``timer``: ``Timer(sample_rate=1.0)`` timing matmuls from one thread per device at once, then from
   one thread switching devices every region; every op's histogram samples must carry only its own
   device label, counts must equal the regions run, nothing may be dropped; the timer's mean GPU time
   is compared with torch.cuda.Event timing of the same matmul on each device.
3. ``server``: one engine + scheduler + model per GPU in this process (tenancy_bench's harness), tenants
   a:0.7 / b:0.3, all saturated at once; per GPU: decode batch rows, steps/s, tokens/s, measured
   GPU-second shares and their error in points (target ≤ 2), and the device label each engine's steps
   were timed under (the engine thread makes its model's device current); then one engine alone in a
   fresh process on the last GPU, built in ``gpuscope serve``'s order (what one
   ``gpuscope serve --model.device cuda:N`` process does, without HTTP). Each engine's timer has its
   own registry, so the device label its steps are timed under is checked too.
4. ``serve``: ``gpuscope serve --model.device cuda:N`` on the last GPU as a child process: one
   completion over HTTP, then its prefill and decode steps must appear on its /metrics under
   ``device="N"`` and nowhere else.

Imports only the standard library, torch, pynvml (through the exporter), prometheus_client and gpuscope
(from ``src/`` by path). Without two CUDA devices the GPU parts are skipped with the reason;
``--cpu-stand-in 2`` runs them on CPU stand-ins instead (a code-path check: the numbers mean nothing).
Writes ``--out`` (default ``benchmarks/results/multi-gpu-h200.json``, the current result), progress
on stderr, a table last. About 4 min with defaults on 2×H200 (``--deadline`` stops it, writing what
it has, at 420 s); exit status 1 when a part, or a section of one, failed or could not measure what
it exists to measure (each is named on stderr, in the table and under ``failures`` in the JSON).

    python benchmarks/multi_gpu_bench.py                               # on the GPU host
    python benchmarks/multi_gpu_bench.py --quick --out /tmp/x.json     # CPU smoke, ~20 s
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # exporter_bench's and tenancy_bench's helpers

import torch
from benchlib import logger, percentile, rnd, utc_now, write_json
from exporter_bench import Scraper, free_port, sample_value, start_exporter, wait_ready
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from tenancy_bench import SIZES, Size, measure_shares, warm_up

from gpuscope.contract import catalogue as cat
from gpuscope.ops import procs
from gpuscope.server.model import build_model
from gpuscope.server.step_timing import build_timer, instrument_model
from gpuscope.timing import Timer

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("exporter", "timer", "server", "serve")
TARGETS = {"scrape_p99_ms": 5.0, "memory_used_diff_mib": 256, "process_on_both_gpus": True,
           "timer_device_labels_right": True, "timer_dropped_samples": 0, "share_error_points": 2.0}
MIB = 1 << 20

# The child that uses two GPUs: holds its allocation until the parent closes its stdin.
CHILD_CODE = """
import json, os, sys, torch
count, mib = int(sys.argv[1]), int(sys.argv[2])
held = [torch.ones(mib << 20, dtype=torch.uint8, device=f"cuda:{i}") for i in range(count)]
for i in range(count):
    torch.cuda.synchronize(i)
def uuid(i):
    try:
        return str(torch.cuda.get_device_properties(i).uuid)
    except Exception:
        return ""
print(json.dumps({"pid": os.getpid(), "uuids": [uuid(i) for i in range(count)]}), flush=True)
sys.stdin.read()
"""

_children: list[procs.Child] = []  # killed by the deadline watchdog if it fires
log = logger("multi_gpu_bench")


def series(body: bytes) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of an exposition as (name, labels, value)."""
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(body.decode())
            for s in family.samples]


def by_label(samples: list[tuple[str, dict[str, str], float]], name: str, label: str) -> dict[str, float]:
    return {labels[label]: value for n, labels, value in samples if n == name and label in labels}


def norm_uuid(uuid: str) -> str:
    # NVML says "GPU-<uuid>", torch's device properties give the bare uuid.
    return uuid.lower().removeprefix("gpu-")


# --- part 1: exporter ---------------------------------------------------------------------------------


class Child:
    """A process holding memory on the first ``count`` CUDA devices until told to exit."""

    def __init__(self, count: int, mib: int) -> None:
        self.child = procs.Child([sys.executable, "-c", CHILD_CODE, str(count), str(mib)], name="child",
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE).start()
        _children.append(self.child)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.child.popen is not None and self.child.popen.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # closed by stop()
            for line in self.child.popen.stdout:
                self.lines.put(line)

    def wait_ready(self, timeout: float) -> dict:
        """The child's pid and device uuids once its allocation is done, and when that was (Unix time)."""
        try:
            info = json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise RuntimeError(f"child not ready in {timeout:.0f}s (exit {self.child.poll()}): "
                               f"{self.child.tail()[-2000:]}") from None
        info["ready_unix"] = time.time()
        return info

    def stop(self) -> None:
        popen = self.child.popen
        if popen is not None and popen.stdin is not None:
            with contextlib.suppress(OSError):
                popen.stdin.close()  # the child's "exit now"
        self.child.wait(15)
        self.child.stop()


def wait_for_round(scraper: Scraper, collector: str, after_unix: float, timeout: float) -> bytes:
    """The first scrape whose ``collector`` round finished after ``after_unix`` (its values are newer)."""
    name = f'gpuscope_exporter_last_success_timestamp_seconds{{collector="{collector}"}}'
    deadline = time.monotonic() + timeout
    while True:
        _, body = scraper.scrape()
        if (sample_value(body, name) or 0) > after_unix or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def exporter_gpus(samples: list) -> dict[str, str]:
    """gpu label → normalised uuid, from gpuscope_gpu_info."""
    return {labels["gpu"]: norm_uuid(labels.get("uuid", "")) for name, labels, _ in samples
            if name == cat.GPU_INFO.name and "gpu" in labels}


def query_smi() -> list[dict] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = ["--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
    out = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30, check=True).stdout
    rows = []
    for line in out.strip().splitlines():
        index, uuid, used, total = (field.strip() for field in line.split(","))
        rows.append({"index": index, "uuid": norm_uuid(uuid), "used_mib": float(used),
                     "total_mib": float(total)})
    return rows


def compare_with_smi(scraper: Scraper, since_unix: float, tolerance_mib: float) -> dict:
    """GPU set and memory.used per GPU, exporter vs nvidia-smi, read right around each other.

    The exporter's values are up to one sampling interval old and nvidia-smi reads now; the child's
    allocation is static meanwhile, so the nearer of the scrapes before and after the query is used.
    NVML's v2 "used" leaves out driver-reserved memory; both readings (with and without it) are shown
    and the GPU agrees when either is within the tolerance."""
    if shutil.which("nvidia-smi") is None:
        return {"skipped": "nvidia-smi not found"}
    if not exporter_gpus(series(scraper.scrape()[1])):
        return {"skipped": "the exporter sees no GPU"}
    body = wait_for_round(scraper, "device", since_unix, 15)
    smi = query_smi() or []
    _, after = scraper.scrape()
    gpus = exporter_gpus(series(body))
    readings = [series(b) for b in (body, after)]
    used = [by_label(s, cat.GPU_MEMORY_USED.name, "gpu") for s in readings]
    reserved = [by_label(s, cat.GPU_MEMORY_RESERVED.name, "gpu") for s in readings]
    label_of = {uuid: label for label, uuid in gpus.items()}
    per_gpu = {}
    for row in smi:
        label = label_of.get(row["uuid"])
        if label is None:
            per_gpu[f"smi:{row['index']}"] = {"missing_from_exporter": True, "uuid": row["uuid"]}
            continue
        plain = min(abs(u.get(label, math.nan) / MIB - row["used_mib"]) for u in used)
        with_reserved = min(abs((u.get(label, math.nan) + r.get(label, 0.0)) / MIB - row["used_mib"])
                            for u, r in zip(used, reserved, strict=True))
        best = min(plain, with_reserved)
        per_gpu[label] = {"smi_index": row["index"], "uuid": row["uuid"], "smi_used_mib": row["used_mib"],
                          "exporter_used_mib": rnd(used[-1].get(label, math.nan) / MIB, 1),
                          "diff_mib": rnd(plain, 1), "diff_incl_reserved_mib": rnd(with_reserved, 1),
                          "best_diff_mib": rnd(best, 1),
                          "diff_pct_of_total": rnd(100 * best / row["total_mib"], 3),
                          "agrees": best <= tolerance_mib}
    smi_uuids = {row["uuid"] for row in smi}
    return {"exporter_gpus": len(gpus), "smi_gpus": len(smi),
            "gpu_set_equal": set(gpus.values()) == smi_uuids,
            # a plain GPU's label is its NVML index, which nvidia-smi's index also is
            "labels_are_smi_indexes": all(v.get("smi_index") == k for k, v in per_gpu.items()
                                          if not v.get("missing_from_exporter")),
            "labels_distinct": len(gpus) == len(set(gpus)),
            "tolerance_mib": tolerance_mib, "per_gpu": per_gpu,
            "memory_used_agrees": all(v.get("agrees", False) for v in per_gpu.values())}


def poll_processes(scraper: Scraper, child: dict, mib: int, deadline_s: float) -> dict:
    """Until the child's pid is listed on every GPU it uses (or the deadline). NVML reports pids of
    the host's pid namespace: if this runs in a container without ``pid: host``, the child's own pid
    never shows, so a pid that appears on all the child's GPUs holding at least its allocation (and
    is not this process) is accepted instead, and ``matched_by`` says so."""
    started = time.monotonic()
    _, body = scraper.scrape()
    by_uuid = {uuid: label for label, uuid in exporter_gpus(series(body)).items()}
    expected = [by_uuid.get(norm_uuid(u), str(i)) for i, u in enumerate(child["uuids"])]
    pid, seen, matched_by = str(child["pid"]), {}, None
    while matched_by is None and time.monotonic() - started < deadline_s:
        seen = {}
        for name, labels, value in series(body):
            if name == cat.GPU_PROCESS_MEMORY.name:
                seen.setdefault(labels["gpu"], {})[labels["pid"]] = (labels.get("process", ""), value)
        if all(pid in seen.get(g, {}) for g in expected):
            matched_by = "pid"
        else:
            stand_ins = set.intersection(*({p for p, (_, v) in seen.get(g, {}).items() if v >= mib * MIB}
                                           for g in expected)) - {str(os.getpid())}
            if len(stand_ins) == 1:
                pid = stand_ins.pop()
                matched_by = "not the child's pid (other pid namespace?): the one pid holding its allocation"
        if matched_by is None:
            time.sleep(0.25)
            _, body = scraper.scrape()
    return {"child_pid": child["pid"], "nvml_pid": pid if matched_by else None, "expected_gpus": expected,
            "found_on": [g for g in expected if pid in seen.get(g, {})],
            "process_name": next((seen[g][pid][0] for g in expected if pid in seen.get(g, {})), None),
            "memory_mib": {g: rnd(seen[g][pid][1] / MIB, 1) for g in expected if pid in seen.get(g, {})},
            "seconds_to_appear": rnd(time.monotonic() - started, 2) if matched_by else None,
            "matched_by": matched_by, "on_all_gpus": matched_by is not None,
            "processes_seen": {g: sorted(p) for g, p in seen.items()}}


def scrape_latency(scraper: Scraper, scrapes: int, window_s: float) -> dict:
    """Scrapes spread evenly over the window on one keep-alive connection, as Prometheus does."""
    times, body = [], b""
    spacing, next_at = window_s / max(1, scrapes), time.monotonic()
    for i in range(scrapes):
        elapsed, body = scraper.scrape()
        times.append(elapsed)
        if (i + 1) % max(1, scrapes // 5) == 0:
            log(f"exporter: scrape {i + 1}/{scrapes}, p50 so far {statistics.median(times) * 1e3:.2f} ms")
        next_at += spacing
        time.sleep(max(0.0, next_at - time.monotonic()))
    samples = series(body)
    return {"scrapes": len(times), "window_s": window_s, "p50_ms": rnd(statistics.median(times) * 1e3),
            "p99_ms": rnd(percentile(times, 99) * 1e3), "max_ms": rnd(max(times) * 1e3),
            "exposition_bytes": len(body), "series": len(samples),
            "collection_duration_s": by_label(samples, cat.EXPORTER_COLLECTION_SECONDS.name,
                                              "collector"),
            "gpu_up": by_label(samples, cat.EXPORTER_GPU_UP.name, "gpu")}


def exporter_part(args: argparse.Namespace, cuda_count: int) -> dict:
    result: dict[str, Any] = {"sampling_interval": args.interval, "child_mib_per_gpu": args.child_mib}
    # Started first: its torch import and two CUDA contexts take longer than the exporter's start.
    child = Child(2, args.child_mib) if cuda_count >= 2 else None
    port = free_port()
    log(f"exporter: starting on 127.0.0.1:{port} with --collector.processes")
    proc = start_exporter(port, args.interval, ["--collector.processes", *args.exporter_arg])
    _children.append(proc)
    try:
        body = wait_ready(proc)
        result["gpus"] = int(sample_value(body, cat.EXPORTER_GPUS.name) or 0)
        result["gpu_name"] = next((labels.get("name") for name, labels, _ in series(body)
                                   if name == cat.GPU_INFO.name), None)
        log(f"exporter: ready, {result['gpus']} GPU(s)")
        scraper = Scraper(port)
        ready = {"unix": 0.0}  # memory is compared on exporter readings newer than the child's allocation

        def attribution() -> dict:
            if child is None:
                return {"skipped": f"needs >= 2 CUDA devices (found {cuda_count})"}
            info = child.wait_ready(120)
            ready["unix"] = info["ready_unix"]
            log(f"exporter: child pid {info['pid']} holds {args.child_mib} MiB on cuda:0 and cuda:1; "
                f"waiting for it in the process series (up to {args.process_deadline:g}s)")
            found = poll_processes(scraper, info, args.child_mib, args.process_deadline)
            log(f"exporter: process on all its GPUs: {found['on_all_gpus']}")
            return found

        # each check guarded apart, so a failing child or nvidia-smi still leaves the scrape figures
        result["process_attribution"] = guarded("exporter: process attribution", attribution)
        result["devices"] = guarded("exporter: nvidia-smi comparison",
                                    lambda: compare_with_smi(scraper, ready["unix"], args.mem_tolerance_mib))
        log(f"exporter: {args.scrapes} scrapes over {args.scrape_window:g}s")
        result["scrape"] = scrape_latency(scraper, args.scrapes, args.scrape_window)
    finally:
        if child is not None:
            child.stop()
        proc.stop()
        result["exporter_stderr_tail"] = proc.output()[-2000:]
    return result


# --- part 2: timer ------------------------------------------------------------------------------------


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_label(device: torch.device) -> str:
    """The label the timer gives this device's samples (host-route timers say "cpu")."""
    return str(device.index) if device.type == "cuda" else "cpu"


def region_stats(registry: CollectorRegistry) -> dict[tuple[str, str], list[float]]:
    """(op, device) → [count, sum] of gpuscope_region_gpu_seconds."""
    stats: dict[tuple[str, str], list[float]] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in (cat.REGION_GPU_SECONDS.series("_count"), cat.REGION_GPU_SECONDS.series("_sum")):
                slot = 0 if s.name.endswith("_count") else 1
                stats.setdefault((s.labels["op"], s.labels["device"]), [0.0, 0.0])[slot] = s.value
    return stats


def dropped_samples(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["reason"]: s.value for family in registry.collect() for s in family.samples
            if s.name == cat.TIMER_DROPPED.name}


def reference_times(device: torch.device, a: torch.Tensor, out: torch.Tensor, n: int) -> list[float]:
    """The same matmul timed without gpuscope: torch.cuda.Event pairs (host clock on CPU)."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            torch.matmul(a, a, out=out)
            times.append(time.perf_counter() - t0)
        return times
    pairs = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, a, out=out)
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) / 1e3 for s, e in pairs]


def timer_part(args: argparse.Namespace, devices: list[torch.device]) -> dict:
    registry = CollectorRegistry()
    timer = Timer(registry=registry, sample_rate=1.0)
    n, size = args.timer_regions, args.timer_matmul
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    try:
        mats = [(torch.randn(size, size, device=d, dtype=dtype),
                 torch.empty(size, size, device=d, dtype=dtype)) for d in devices]
        barrier = threading.Barrier(len(devices))

        def warm(i: int) -> None:
            # cuBLAS makes a handle per thread and device on first use: keep that out of the regions.
            a, out = mats[i]
            with on_device(devices[i]):
                for _ in range(3):
                    torch.matmul(a, a, out=out)
                sync(devices[i])

        def per_device(i: int) -> list[float]:
            a, out = mats[i]
            warm(i)
            region = timer.region(f"matmul_dev{i}")
            with on_device(devices[i]):
                barrier.wait(60)  # both devices busy at the same time
                for _ in range(n):
                    with region:
                        torch.matmul(a, a, out=out)
                sync(devices[i])
                return reference_times(devices[i], a, out, n)

        def switching() -> None:
            for i in range(len(devices)):
                warm(i)
            regions = [timer.region(f"switch_dev{i}") for i in range(len(devices))]
            for _ in range(n):
                for i, (a, out) in enumerate(mats):
                    with on_device(devices[i]), regions[i]:
                        torch.matmul(a, a, out=out)
            for d in devices:
                sync(d)

        log(f"timer: one thread per device, {n} matmuls {size}x{size} each")
        with ThreadPoolExecutor(len(devices)) as pool:
            reference = list(pool.map(per_device, range(len(devices))))
        log("timer: one thread switching devices every region")
        with ThreadPoolExecutor(1) as pool:  # a fresh thread, as an inference worker would be
            pool.submit(switching).result()
        flushed = timer.flush(30)
        stats, dropped = region_stats(registry), dropped_samples(registry)
    finally:
        timer.close()

    # What the histograms can show about "no event on the wrong device's stream": a record on another
    # device's stream fails in CUDA and is counted as a drop (reason "error"); a record on the wrong
    # device's stream that succeeds lands under that device's label. So: right labels, exact counts,
    # zero drops.
    ops, labels_right, counts_right, per_device_report = {}, True, True, {}
    for prefix in ("matmul_dev", "switch_dev"):
        for i, d in enumerate(devices):
            op, want = f"{prefix}{i}", device_label(d)
            counts = {dev: c for (o, dev), (c, _) in stats.items() if o == op and c}
            total_s = sum(s for (o, _dev), (_, s) in stats.items() if o == op)
            labels_right &= set(counts) == {want}
            counts_right &= counts.get(want) == n
            ops[op] = {"expected_device": want, "regions": n, "counts_by_device": counts,
                       "mean_ms": rnd(1e3 * total_s / max(1, sum(counts.values())), 4)}
    for i, d in enumerate(devices):
        events = reference[i]
        timer_mean = ops[f"matmul_dev{i}"]["mean_ms"]
        per_device_report[f"{i}:{d}"] = {
            "timer_mean_ms": timer_mean, "event_mean_ms": rnd(1e3 * statistics.fmean(events), 4),
            "event_median_ms": rnd(1e3 * statistics.median(events), 4),
            # the histogram's sum is exact, its median only known to a bucket: compare means
            "timer_mean_over_event_mean": rnd(timer_mean / (1e3 * statistics.fmean(events)), 4)
            if timer_mean else None}
    return {"devices": [str(d) for d in devices], "route": timer.route.name,
            "matmul": f"{size}x{size} {dtype}", "regions_per_device_per_phase": n, "flushed": flushed,
            "ops": ops, "vs_cuda_events": per_device_report,
            "dropped": dropped, "dropped_total": sum(dropped.values()),
            "device_labels_right": labels_right, "counts_right": counts_right}


# --- part 3: server -----------------------------------------------------------------------------------


def gpu_report(measured: dict, before: dict, after: dict, want: str | None) -> dict:
    """One engine's share window from tenancy_bench.measure_shares, plus where its steps were timed."""
    diag = measured["diagnostics"]
    window = diag["window_s"]
    steps = diag["steps"]

    def rows(op: str) -> float:
        return sum(steps.get(op, {}).get("mean_rows_by_tenant", {}).values())

    # every step emits one token per row, prefill and decode alike
    tokens = sum(steps.get(op, {}).get("steps", 0) * rows(op) for op in ("prefill", "decode"))
    timed_on: dict[str, float] = {}
    for (op, dev), (count, _) in after.items():
        delta = count - before.get((op, dev), [0.0, 0.0])[0]
        if delta:
            timed_on[dev] = timed_on.get(dev, 0.0) + delta
    return {"shares": {t: rnd(v, 4) for t, v in measured["shares"].items()},
            "share_error_points": rnd(measured["share_error_points"], 3),
            "gpu_seconds": {t: rnd(v, 4) for t, v in measured["gpu_seconds"].items()},
            "mean_decode_batch_rows": rnd(rows("decode"), 2),
            "decode_rows_by_tenant": steps.get("decode", {}).get("mean_rows_by_tenant", {}),
            "steps_per_s": rnd(sum(steps.get(op, {}).get("steps", 0) for op in ("prefill", "decode"))
                               / window, 1),
            "tokens_per_s": rnd(tokens / window, 1),
            "decode_step_p50_ms": steps.get("decode", {}).get("p50_ms"),
            "busy_fraction": steps.get("busy_fraction"),
            "requests_started": diag["requests_started"], "errors": diag["errors"],
            "timed_region_device_labels": {dev: int(c) for dev, c in sorted(timed_on.items())},
            # None with --server-timing off: no timer, no labels
            "steps_timed_on_model_device": None if want is None else set(timed_on) == {want}}


def server_size(args: argparse.Namespace, device: torch.device) -> Size:
    base = SIZES[args.server_size]
    return dataclasses.replace(base, model=dataclasses.replace(base.model, device=str(device)),
                               batch=args.server_batch or base.batch, share_warmup_s=args.server_warmup,
                               share_window_s=args.server_window, warmup_s=args.server_engine_warmup)


def probe_serve(args: argparse.Namespace) -> dict:
    """In a fresh process: what one `gpuscope serve --model.device cuda:N` process does (Service's
    order: model, then timer, then per-module instrumentation), without HTTP. The in-process engines
    cannot show this: there the main thread has already made a context on every device."""
    device = torch.device(args.probe_serve)
    size = server_size(args, device)
    registry = CollectorRegistry()
    model = build_model(size.model)
    timer = build_timer(args.server_timing, registry)
    inst = instrument_model(timer, model) if args.server_timing != "off" else None
    try:
        measured = measure_shares(model, timer, size)
        timer.flush(5)
        stats = region_stats(registry)
        dropped = dropped_samples(registry)
    finally:
        if inst is not None:
            inst.remove()
        timer.close()
    report = gpu_report(measured, {}, stats, device_label(device) if args.server_timing != "off" else None)
    report["region_counts_by_op_at_device"] = {f"{op}@{dev}": int(count)
                                               for (op, dev), (count, _) in sorted(stats.items())}
    report["timer_dropped"] = dropped
    return report


def separate_process(args: argparse.Namespace, device: torch.device) -> dict:
    argv = [sys.executable, __file__, "--probe-serve", str(device), "--server-size", args.server_size,
            "--server-batch", str(args.server_batch), "--server-window", str(args.server_window),
            "--server-warmup", str(args.server_warmup), "--server-timing", args.server_timing]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise RuntimeError(f"probe exited {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["what"] = ("one fresh process like `gpuscope serve --model.device " + str(device) + "` (Service's "
                      "order: model, timer, per-module instrumentation), driven without HTTP")
    return result


def server_part(args: argparse.Namespace, devices: list[torch.device]) -> dict:
    base = SIZES[args.server_size]
    sizes = [server_size(args, d) for d in devices]
    wants = [device_label(d) if args.server_timing != "off" else None for d in devices]
    registries = [CollectorRegistry() for _ in devices]
    timers: list[Any] = []
    try:
        for registry in registries:
            timers.append(build_timer(args.server_timing, registry))  # what `gpuscope serve` builds
        pool = ThreadPoolExecutor(len(devices))

        def setup(i: int) -> tuple[Any, dict]:
            torch.manual_seed(0)
            model = build_model(sizes[i].model)
            return model, warm_up(model, timers[i], sizes[i])

        log(f"server: {len(devices)} engine(s), {base.model.layers} layers x {base.model.dim}, "
            f"batch {sizes[0].batch}: warm-up")
        with pool:
            built = list(pool.map(setup, range(len(devices))))
            log(f"server: {args.server_warmup:g}s + {args.server_window:g}s window, all engines at once")
            before = [region_stats(r) for r in registries]
            measured = list(pool.map(lambda i: measure_shares(built[i][0], timers[i], sizes[i]),
                                     range(len(devices))))
            after = [region_stats(r) for r in registries]
            per_gpu = {f"{i}:{d}": gpu_report(measured[i], before[i], after[i], wants[i])
                       for i, d in enumerate(devices)}
            log(f"server: share error points { {k: v['share_error_points'] for k, v in per_gpu.items()} }")
    finally:
        for timer in timers:
            timer.close()
    log(f"server: one engine alone in a fresh process on {devices[-1]}")
    probe = guarded("server: separate process", lambda: separate_process(args, devices[-1]))
    model = base.model
    return {
        "deployment": "one worker per GPU realised as one engine + scheduler + model (+ its own timer and "
                      "registry) per GPU in this process, the same as one `gpuscope serve --model.device "
                      "cuda:N` process per GPU; the engines share this process's GIL, so tokens/s per GPU "
                      "here is a lower bound of separate processes'",
        "devices": [str(d) for d in devices], "tenants": "a:0.7,b:0.3 (share mode)",
        "model": {k: getattr(model, k) for k in ("layers", "dim", "heads", "context")},
        "batch": sizes[0].batch, "closed_loop_outstanding_per_tenant": 2 * sizes[0].batch,
        "prompt_bytes": base.prompt_bytes, "max_tokens": base.max_tokens, "timing": args.server_timing,
        "warmup_s": args.server_warmup, "window_s": args.server_window,
        "engine_warm_up_excluded": {f"{i}:{d}": built[i][1] for i, d in enumerate(devices)},
        "per_gpu": per_gpu, "separate_process": probe}


def serve_part(args: argparse.Namespace, devices: list[torch.device]) -> dict:
    """``gpuscope serve --model.device cuda:N`` on the last GPU, as a user starts it: one completion
    over HTTP, then its steps must be timed under ``device="N"`` on its own /metrics."""
    from gpuscope.loadtest.serverproc import ServerProcess

    device = devices[-1]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["--model.device", str(device), "--timing", args.server_timing],
                               log_path=Path(tmp) / "serve.log")
        log(f"serve: `gpuscope serve --model.device {device}` over HTTP")
        with server:
            body = json.dumps({"prompt": "Hello", "max_tokens": 16}).encode()
            request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                completion = json.loads(response.read())
            deadline = time.monotonic() + 30
            while True:  # the step samples reach /metrics when the resolver has taken them
                with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
                    samples = series(response.read())
                steps = {(labels["op"], labels["device"]): value for name, labels, value in samples
                         if name == cat.REGION_GPU_SECONDS.name + "_count"
                         and labels.get("op") in ("prefill", "decode")}
                if args.server_timing == "off" or {"prefill", "decode"} <= {op for op, _ in steps} \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            log_tail = (Path(tmp) / "serve.log").read_text(errors="replace")[-2000:]
    want = device_label(device)
    return {"command": f"gpuscope serve --model.device {device} --timing {args.server_timing}",
            "completion_tokens": completion.get("usage", {}).get("completion_tokens"),
            "step_counts_by_op_at_device": {f"{op}@{dev}": int(v) for (op, dev), v in sorted(steps.items())},
            "steps_timed_on_model_device": None if args.server_timing == "off" else
            bool(steps) and {dev for _, dev in steps} == {want},
            "warnings_in_log": [line for line in log_tail.splitlines()
                                if " ERROR " in line or " WARNING " in line]}


# --- driver -------------------------------------------------------------------------------------------


def guarded(name: str, fn: Callable[[], dict]) -> dict:
    started = time.monotonic()
    try:
        result = fn()
    except (Exception, SystemExit) as exc:  # exporter_bench.wait_ready exits on failure
        log(f"{name}: failed: {type(exc).__name__}: {exc}")
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def all_or_none(values: list[bool | None]) -> bool | None:
    return None if not values or None in values else all(values)


def summarise(parts: dict) -> dict:
    exp, tim, srv, http = (parts.get(p, {}) for p in PARTS)
    devices = exp.get("devices", {})
    process = exp.get("process_attribution", {})
    per_gpu = devices.get("per_gpu", {})
    gpus = srv.get("per_gpu", {})
    errors = {g: v["share_error_points"] for g, v in gpus.items()}
    summary = {
        "scrape_p99_ms": exp.get("scrape", {}).get("p99_ms"),
        "gpus_match_nvidia_smi": devices.get("gpu_set_equal"),
        "memory_used_agrees": devices.get("memory_used_agrees"),
        "max_memory_diff_mib": max((v["best_diff_mib"] for v in per_gpu.values()
                                    if v.get("best_diff_mib") is not None), default=None),
        "process_on_both_gpus": process.get("on_all_gpus"),
        "process_matched_by": process.get("matched_by"),
        "timer_device_labels_right": tim.get("device_labels_right"),
        "timer_counts_right": tim.get("counts_right"),
        "timer_dropped_samples": tim.get("dropped_total"),
        "timer_mean_over_event_mean": {k: v["timer_mean_over_event_mean"]
                                       for k, v in tim.get("vs_cuda_events", {}).items()},
        "share_error_points": errors,
        "server_steps_timed_on_model_device": all_or_none([v["steps_timed_on_model_device"]
                                                           for v in gpus.values()]) if gpus else None,
        "tokens_per_s": {g: v["tokens_per_s"] for g, v in gpus.items()},
        "separate_process_steps_timed_on_model_device":
            srv.get("separate_process", {}).get("steps_timed_on_model_device"),
        "serve_steps_timed_on_model_device": http.get("steps_timed_on_model_device"),
    }
    worst = max(errors.values()) if errors and None not in errors.values() else None
    p99 = summary["scrape_p99_ms"]
    summary["checks"] = {
        "scrape_p99_le_5ms": None if p99 is None else p99 <= TARGETS["scrape_p99_ms"],
        "memory_used_agrees": summary["memory_used_agrees"],
        "process_on_both_gpus": summary["process_on_both_gpus"],
        "timer_device_labels_right": summary["timer_device_labels_right"],
        "timer_no_drops": None if tim.get("dropped_total") is None else tim["dropped_total"] == 0,
        "share_error_le_2_points": None if worst is None else worst <= TARGETS["share_error_points"],
        "server_steps_timed_on_model_device": summary["server_steps_timed_on_model_device"],
        "serve_like_process_timed_on_its_device": summary["separate_process_steps_timed_on_model_device"],
        "serve_over_http_timed_on_its_device": summary["serve_steps_timed_on_model_device"],
    }
    return summary


#: where each check's figure comes from: (part, section inside the part or None)
CHECK_SOURCES = {
    "scrape_p99_le_5ms": ("exporter", "scrape"),
    "memory_used_agrees": ("exporter", "devices"),
    "process_on_both_gpus": ("exporter", "process_attribution"),
    "timer_device_labels_right": ("timer", None),
    "timer_no_drops": ("timer", None),
    "share_error_le_2_points": ("server", None),
    "server_steps_timed_on_model_device": ("server", None),
    "serve_like_process_timed_on_its_device": ("server", "separate_process"),
    "serve_over_http_timed_on_its_device": ("serve", None),
}


def errors_in(section: Any, path: str) -> list[str]:
    """Every ``error`` recorded anywhere under ``section``, named by its path."""
    if not isinstance(section, dict):
        return []
    error = section.get("error")  # a string; drop counters have an "error" reason too (a number)
    found = [f"{path}: {error.splitlines()[0]}"] if isinstance(error, str) else []
    for key, value in section.items():
        found += errors_in(value, f"{path}.{key}")
    return found


def failures(report: dict) -> list[str]:
    """Why the bench failed: a part or section that crashed, or a check whose part ran but which
    has no value (it could not measure what it exists to measure). Missed targets are results,
    reported beside their checks, not failures of the bench."""
    found = [e for name, part in report["parts"].items() for e in errors_in(part, name)]
    for check, value in report["summary"]["checks"].items():
        part_name, section_name = CHECK_SOURCES[check]
        part = report["parts"].get(part_name)
        if value is not None or part is None or "skipped" in part or "error" in part:
            continue
        section = part.get(section_name, {}) if section_name else part
        if "skipped" in section or "error" in section:
            continue
        found.append(f"{part_name}: check {check} has no value (nothing measured)")
    return found


def table(report: dict) -> str:
    s = report["summary"]

    def show(value: Any) -> str:
        if value is None:
            return "-"  # a skipped part; an unmeasured check of a part that ran is listed as FAILED
        return json.dumps(value) if isinstance(value, dict | list) else str(value)

    rows = [("GPU", f"{report['gpu']} ({report['gpu_count']} CUDA device(s))")]
    rows += [(f"part {name}", "error: " + part["error"].splitlines()[0] if "error" in part
              else f"skipped: {part['skipped']}" if "skipped" in part else f"ran ({part.get('wall_s')} s)")
             for name, part in report["parts"].items()]
    rows += [("scrape p99 (target ≤ 5 ms)", show(s["scrape_p99_ms"])),
             ("GPU set = nvidia-smi", show(s["gpus_match_nvidia_smi"])),
             ("memory.used agrees (max diff MiB)", f"{show(s['memory_used_agrees'])} "
                                                   f"({show(s['max_memory_diff_mib'])})"),
             ("process on both GPUs", f"{show(s['process_on_both_gpus'])} ({show(s['process_matched_by'])})"),
             ("timer device labels / counts right", f"{show(s['timer_device_labels_right'])} / "
                                                    f"{show(s['timer_counts_right'])}"),
             ("timer drops", show(s["timer_dropped_samples"])),
             ("timer mean / cuda event mean", show(s["timer_mean_over_event_mean"] or None))]
    rows.append(("share error points per GPU (≤ 2)", show(s["share_error_points"] or None)))
    rows.append(("steps timed on model's device", show(s["server_steps_timed_on_model_device"])))
    rows.append(("tokens/s per GPU", show(s["tokens_per_s"] or None)))
    rows.append(("serve-like process on last GPU: timed on its device",
                 show(s["separate_process_steps_timed_on_model_device"])))
    rows.append(("`gpuscope serve` on last GPU over HTTP: timed on its device",
                 show(s["serve_steps_timed_on_model_device"])))
    missed = [check for check, ok in s["checks"].items() if ok is False]
    rows.append(("targets missed", ", ".join(missed) or "none"))
    rows += [("FAILED", failure) for failure in report["failures"]]
    rows.append(("written", report["out"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write(report: dict) -> None:
    write_json(report["out"], report, default=str)


def start_watchdog(report: dict, seconds: float) -> threading.Timer:
    """If the run overstays, write what it has and exit, so a one-shot run still returns a file."""

    def fire() -> None:
        log(f"deadline of {seconds:.0f}s reached: writing partial results and exiting")
        report["deadline_reached"] = True
        report["failures"] = [f"{report.get('in_progress')}: cut short by the {seconds:.0f}s deadline"]
        with contextlib.suppress(Exception):
            report["summary"] = summarise(report["parts"])
        for child in _children:
            child.kill()
        for _ in range(3):  # the main thread may be changing the report meanwhile
            try:
                write(report)
                break
            except Exception:
                time.sleep(0.5)
        os._exit(3)

    watchdog = threading.Timer(seconds, fire)
    watchdog.daemon = True
    watchdog.start()
    return watchdog


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (~20 s): a smoke test")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/multi-gpu-h200.json"), help="JSON path")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    p.add_argument("--gpus", type=int, default=0, help="CUDA devices for the timer and server parts (0: all)")
    p.add_argument("--cpu-stand-in", type=int, default=0, metavar="N",
                   help="without 2 CUDA devices, run timer and server on N CPU stand-ins (code-path check)")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds before partial results are written")
    g = p.add_argument_group("exporter part")
    g.add_argument("--scrapes", type=int, help="scrapes for the latency figure (300; quick 20)")
    g.add_argument("--scrape-window", type=float, help="seconds the scrapes are spread over (30; quick 2)")
    g.add_argument("--interval", default="1s", help="exporter --sampling.interval")
    g.add_argument("--exporter-arg", action="append", default=[], help="extra exporter flag (repeatable)")
    g.add_argument("--child-mib", type=int,
                   help="MiB the child holds on each of cuda:0 and cuda:1 (1024; quick 256)")
    g.add_argument("--process-deadline", type=float, default=45.0,
                   help="seconds to wait for the child in the process series (slow cadence is 10 s)")
    g.add_argument("--mem-tolerance-mib", type=float, default=256.0, help="memory.used agreement, MiB")
    g = p.add_argument_group("timer part")
    g.add_argument("--timer-regions", type=int, help="regions per device per phase (200; quick 20)")
    g.add_argument("--timer-matmul", type=int,
                   help="square matmul size (8192 on CUDA, 128 on CPU; quick 1024)")
    g = p.add_argument_group("server part")
    g.add_argument("--server-size", choices=sorted(SIZES),
                   help="tenancy_bench size (h200 on CUDA, else cpu; quick cpu)")
    g.add_argument("--server-batch", type=int, default=0, help="batch slots per engine (0: the size's)")
    g.add_argument("--server-window", type=float, help="measured seconds of the share window (20; quick 2)")
    g.add_argument("--server-warmup", type=float, help="unmeasured seconds before each window (3; quick 0.5)")
    g.add_argument("--server-engine-warmup", type=float,
                   help="tenancy_bench warm-up run, once (4; quick 0.5)")
    g.add_argument("--server-timing", choices=("budget", "all", "off"), default="budget")
    g.add_argument("--probe-serve", metavar="DEVICE", help=argparse.SUPPRESS)  # the separate-process run
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    defaults = {"scrapes": (300, 20), "scrape_window": (30.0, 2.0), "child_mib": (1024, 256),
                "timer_regions": (200, 20), "timer_matmul": (8192 if cuda else 128, 1024 if cuda else 128),
                "server_size": ("h200" if cuda else "cpu", "cpu"), "server_window": (20.0, 2.0),
                "server_warmup": (3.0, 0.5), "server_engine_warmup": (4.0, 0.5)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.quick:
        args.process_deadline = min(args.process_deadline, 30.0)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_serve:
        print(json.dumps(probe_serve(args), default=str))
        return 0
    wanted = [part for part in PARTS if part in args.parts.split(",")]
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    count = min(cuda_count, args.gpus) if args.gpus else cuda_count
    devices = [torch.device(f"cuda:{i}") for i in range(count)]
    if count < 2 and args.cpu_stand_in:
        devices = [torch.device("cpu")] * args.cpu_stand_in
    skip = None if len(devices) >= 2 else f"needs >= 2 CUDA devices (found {count})"
    serve_skip = {"skipped": skip or "needs CUDA devices (stand-ins are in-process)"} \
        if skip or devices[-1].type != "cuda" else None
    report: dict[str, Any] = {"gpu": None, "gpu_count": cuda_count,
                              "date": utc_now(),
                              "torch": torch.__version__, "quick": args.quick, "out": args.out,
                              "parts": {}, "targets": TARGETS}
    watchdog = start_watchdog(report, args.deadline)
    started = time.monotonic()
    log(f"{cuda_count} CUDA device(s); parts {','.join(wanted)}; devices for timer/server "
        f"{[str(d) for d in devices]}")
    # The exporter goes first: its process check must not see this process holding GPU memory.
    runs = {"exporter": lambda: exporter_part(args, cuda_count),
            "timer": lambda: {"skipped": skip} if skip else timer_part(args, devices),
            "server": lambda: {"skipped": skip} if skip else server_part(args, devices),
            "serve": lambda: serve_skip or serve_part(args, devices)}
    for name in wanted:
        log(f"part {name}")
        report["in_progress"] = name  # what a deadline cut short, if it fires
        report["parts"][name] = guarded(name, runs[name])
    report.pop("in_progress", None)
    watchdog.cancel()
    report["gpu"] = torch.cuda.get_device_name(0) if cuda_count else "none (cpu)"
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["summary"] = summarise(report["parts"])
    report["failures"] = failures(report)
    write(report)
    print(table(report))
    for failure in report["failures"]:
        log(f"FAILED {failure}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
