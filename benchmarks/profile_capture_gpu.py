"""A profile captured on an alert shows the slowed kernel: server on the GPU, fault injected, receiver asks.

    python benchmarks/profile_capture_gpu.py --out DIR     # ~1 min on the H200; also runs on CPU (regions)

1. ``gpuscope serve`` on the GPU (4 layers, d 1024, bf16) with faults and profile captures on
   (``--timing.kernel-busy`` too where ``cupti-python`` imports), and ``gpuscope receiver`` with that
   server in its allow-list; eight client threads keep it busy.
2. A ``GPUStepLatencySpike`` notification, shaped as Alertmanager posts it, to the receiver: it asks
   the server for a capture (the baseline).
3. The ``latency_spike`` fault (extra passes of every MLP's work), then the same notification again.
4. Both traces read back through the links in the receiver's records: kernels by CUPTI name, per
   step, and the GPU time of each module's range; which kernels grew; each capture's own cost
   (``throughput_loss_ratio``, engine stall); with the kernel busy window on, whether its windows
   still succeed after torch.profiler had CUPTI.

Writes ``DIR/profile-capture-summary.json`` and ``DIR/server.log``, and the fault capture's trace
when it is under 1 MB.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))

from benchlib import write_json  # noqa: E402

from gpuscope.util.freeport import free_ports  # noqa: E402

TOKEN = "bench-profile-token-0123456789"
INSTANCE = "h200-server:8000"
ALERT = "GPUStepLatencySpike"


def http(method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 30) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def wait(check, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except (OSError, ValueError):
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def metric(base: str, name: str, labels: str = "") -> float | None:
    text = http("GET", base + "/metrics")
    key = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(key):
            return float(line.split()[-1])
    return None


def notification(status: str = "firing") -> dict:
    """What Alertmanager 0.25 posts to a webhook (version 4)."""
    labels = {"alertname": ALERT, "instance": INSTANCE, "severity": "warning"}
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{ALERT}"}}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "gpuscope-receiver",
        "groupLabels": {"alertname": ALERT},
        "commonLabels": labels,
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": {"summary": "decode steps slow"},
                "startsAt": datetime.datetime.now(datetime.UTC).isoformat(),
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "",
                "fingerprint": "0123456789abcdef",
            }
        ],
    }


class Load:
    def __init__(self, base: str, threads: int, max_s: float) -> None:
        self.base, self.stop, self.deadline = base, threading.Event(), time.monotonic() + max_s
        self.done = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            try:
                http(
                    "POST", self.base + "/v1/completions", {"prompt": "Tell me about GPUs", "max_tokens": 64}
                )
                self.done += 1
            except (OSError, ValueError):
                time.sleep(0.1)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def capture_via_receiver(receiver: str) -> dict:
    """Post the alert to the receiver; the profile entry of its record, and the capture once written."""
    before = len(http("GET", receiver + "/alerts")["notifications"])
    t0 = time.monotonic()
    http("POST", receiver + "/alerts", notification())
    record = wait(
        lambda: (r := http("GET", receiver + "/alerts")["notifications"])[before:] and r[-1],
        30,
        "the receiver's record",
    )
    entry = record["profiles"][0]
    if entry["result"] != "requested":
        raise RuntimeError(f"the receiver's profile request failed: {entry}")
    status = wait(
        lambda: (s := http("GET", entry["status_url"], token=TOKEN))["state"] == "done" and s,
        90,
        "the capture written",
    )
    return {"receiver_entry": entry, "status": status, "alert_to_written_s": round(time.monotonic() - t0, 3)}


def summarize(trace: dict, steps: int) -> dict:
    """Kernels by name (count and µs per step), and each module range's GPU time per step."""
    events = trace["traceEvents"]
    kernels: dict[str, list[float]] = defaultdict(list)
    modules: dict[str, float] = defaultdict(float)
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X":
            continue
        if cat == "kernel":
            kernels[e["name"]].append(float(e.get("dur", 0)))
        elif cat in ("gpu_user_annotation", "region"):
            modules[e["name"]] += float(e.get("dur", 0))
    per_step = max(1, steps)
    by_name = {
        name: {
            "count_per_step": round(len(d) / per_step, 2),
            "us_per_step": round(sum(d) / per_step, 2),
            "mean_us": round(sum(d) / len(d), 3),
        }
        for name, d in kernels.items()
    }
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1]["us_per_step"])[:12])
    return {
        "events": len(events),
        "step_marks": sum(str(e.get("name", "")).startswith("ProfilerStep#") for e in events),
        "kernels": sum(len(d) for d in kernels.values()),
        "kernel_us_per_step": round(sum(sum(d) for d in kernels.values()) / per_step, 2),
        "top_kernels": top,
        "all_kernels": by_name,
        "module_us_per_step": {
            k: round(v / per_step, 2) for k, v in sorted(modules.items()) if not k.startswith("ProfilerStep")
        },
    }


def grown(base: dict, fault: dict) -> list[dict]:
    """Kernels whose GPU time per step grew most from the baseline capture to the fault capture."""
    rows = []
    for name, f in fault["all_kernels"].items():
        b = base["all_kernels"].get(name, {"count_per_step": 0.0, "us_per_step": 0.0})
        rows.append(
            {
                "kernel": name,
                "count_per_step": [b["count_per_step"], f["count_per_step"]],
                "us_per_step": [b["us_per_step"], f["us_per_step"]],
                "growth_us_per_step": round(f["us_per_step"] - b["us_per_step"], 2),
            }
        )
    return sorted(rows, key=lambda r: -r["growth_us_per_step"])[:6]


def cupti_works() -> bool:
    """Whether cupti-python imports and can switch kernel activity on (a version mismatch fails here)."""
    try:
        from cupti import cupti

        kind = cupti.ActivityKind.CONCURRENT_KERNEL
        cupti.activity_enable(kind)
        cupti.activity_disable(kind)
        return True
    except Exception as exc:  # ImportError, or CUPTI's own error
        print(f"kernel busy window off: cupti-python unusable here ({type(exc).__name__}: {exc})")
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--extra-passes", type=int, default=4)
    parser.add_argument(
        "--busy-budget",
        type=float,
        default=0.05,
        help="--timing.budget with the kernel busy window: its windows come every "
        "max(10 s, cost / (0.25 × budget)), so a larger budget lets one fall due in the run",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="profile-bench-")
    busy = cupti_works()
    import torch

    gpu = torch.cuda.is_available()
    ports = free_ports(["server", "receiver"])
    sport, rport = ports["server"], ports["receiver"]
    server, receiver = f"http://127.0.0.1:{sport}", f"http://127.0.0.1:{rport}"
    servers_file = os.path.join(work, "servers.json")
    with open(servers_file, "w") as f:
        json.dump({"servers": {INSTANCE: server}, "steps": args.steps}, f)
    env = {
        **os.environ,
        "GPUSCOPE_PROFILE_TOKEN": TOKEN,
        "GPUSCOPE_FAULTS_TOKEN": TOKEN,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    serve = [
        sys.executable,
        "-m",
        "gpuscope",
        "serve",
        "--web.listen-address",
        f"127.0.0.1:{sport}",
        "--model.layers",
        str(args.layers),
        "--model.dim",
        str(args.dim),
        "--model.heads",
        "16",
        "--model.context",
        "512",
        "--request.max-tokens",
        "128",
        "--batch.max-size",
        "8",
        "--faults.enable",
        "--profile.enable",
        "--profile.min-interval",
        "0",
        "--profile.dir",
        os.path.join(work, "traces"),
    ] + (["--timing.kernel-busy", "--timing.budget", str(args.busy_budget)] if busy and gpu else [])
    log_path = os.path.join(args.out, "server.log")
    log = open(log_path, "w")  # noqa: SIM115 (held by the child processes until they stop)
    procs = [subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)]
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuscope",
                "receiver",
                "--web.listen-address",
                f"127.0.0.1:{rport}",
                "--receiver.profile-servers",
                servers_file,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    )
    summary: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "kernel_busy_window": busy and gpu,
        "model": {"layers": args.layers, "dim": args.dim, "batch_max": 8, "clients": 8},
        "steps_per_capture": args.steps,
        "fault": {"latency_spike": {"extra_passes": args.extra_passes}},
    }
    try:
        t0 = time.monotonic()

        def ready() -> bool:
            if procs[0].poll() is not None:
                raise SystemExit(f"the server exited with {procs[0].returncode}; see {log_path}")
            return http("GET", server + "/readyz")["status"] == "ready"

        wait(ready, 120, "the server")
        wait(lambda: http("GET", receiver + "/healthz")["status"] == "ok", 30, "the receiver")
        summary["server_ready_s"] = round(time.monotonic() - t0, 1)
        with Load(server, 8, 240) as load:
            wait(lambda: load.done >= 16, 60, "16 completions (warm-up)")
            base = capture_via_receiver(receiver)
            http(
                "POST",
                server + "/admin/faults/latency_spike",
                {"extra_passes": args.extra_passes, "duration_s": 120},
                token=TOKEN,
            )
            time.sleep(2.0)  # the engine applies the fault between steps; let a few slow steps pass
            fault = capture_via_receiver(receiver)
            http("DELETE", server + "/admin/faults/latency_spike", token=TOKEN)
            if summary["kernel_busy_window"]:
                name = "gpuscope_timer_kernel_busy_windows_total"
                after = metric(server, name, 'outcome="ok"') or 0.0
                try:
                    wait(
                        lambda: (metric(server, name, 'outcome="ok"') or 0.0) > after,
                        30,
                        "a kernel busy window after the captures",
                    )
                    summary["busy_window_ok_after_capture"] = True
                except TimeoutError:
                    summary["busy_window_ok_after_capture"] = False
                summary["busy_windows"] = {
                    o: metric(server, name, f'outcome="{o}"') for o in ("ok", "timeout", "failed")
                }
        traces = {}
        for label, cap in (("baseline", base), ("fault", fault)):
            url = cap["receiver_entry"]["trace_url"]
            raw = urllib.request.urlopen(
                urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"}), timeout=60
            ).read()
            traces[label] = raw
            trace = json.loads(raw)
            status = cap["status"]
            summary[label] = {
                "mode": status["mode"],
                "outcome": status["outcome"],
                "steps_captured": status["steps_captured"],
                "bytes": status["bytes"],
                "events_left_out": status["events_left_out"],
                "throughput_loss_ratio": status["throughput_loss_ratio"],
                "engine_stall_s": status["stall_s"],
                "window_s": status["window_s"],
                "alert_to_written_s": cap["alert_to_written_s"],
                "trace_url": url,
                **summarize(trace, status["steps_captured"]),
            }
            summary[label].pop("all_kernels")
            summary[label]["_all"] = summarize(trace, status["steps_captured"])["all_kernels"]
        summary["grown_kernels"] = grown(
            {"all_kernels": summary["baseline"].pop("_all")}, {"all_kernels": summary["fault"].pop("_all")}
        )
        for label in ("baseline", "fault"):
            mlp = {k: v for k, v in summary[label]["module_us_per_step"].items() if k.endswith(".mlp")}
            summary[label]["mlp_us_per_step"] = round(sum(mlp.values()), 2)
        summary["profile_metrics"] = {
            "captures_ok": metric(
                server, "gpuscope_profile_captures_total", f'mode="{summary["fault"]["mode"]}",outcome="ok"'
            ),
            "throughput_loss_ratio_last": metric(server, "gpuscope_profile_throughput_loss_ratio"),
            "stall_seconds_total": metric(server, "gpuscope_profile_stall_seconds_total"),
            "trace_bytes_last": metric(server, "gpuscope_profile_trace_bytes"),
            "receiver_requested": metric(
                receiver, "gpuscope_receiver_profile_requests_total", 'result="requested"'
            ),
        }
        if len(traces["fault"]) < 1_000_000:
            with open(os.path.join(args.out, "profile-capture-fault-trace.json"), "wb") as f:
                f.write(traces["fault"])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    with open(log_path) as f:
        lines = f.readlines()
    summary["log_lines"] = [
        line.strip()[line.index("{") :] for line in lines if '"event":"profile_captured"' in line
    ]
    summary["warm_up_log"] = [line.strip() for line in lines if "torch.profiler warm" in line]
    write_json(os.path.join(args.out, "profile-capture-summary.json"), summary, indent=1)
    for label in ("baseline", "fault"):
        s = summary[label]
        per_step = s["kernels"] / max(1, s["steps_captured"])
        print(
            f"{label:9} mode={s['mode']} steps={s['steps_captured']} kernels/step={per_step:.0f} "
            f"kernel_us/step={s['kernel_us_per_step']} mlp_us/step={s['mlp_us_per_step']} "
            f"loss={s['throughput_loss_ratio']} stall_s={s['engine_stall_s']} bytes={s['bytes']}"
        )
    for row in summary["grown_kernels"]:
        print(
            f"  grew {row['growth_us_per_step']:>9} us/step  count/step {row['count_per_step']}  "
            f"{row['kernel'][:90]}"
        )
    print(
        "busy window ok after capture:",
        summary.get("busy_window_ok_after_capture"),
        summary.get("busy_windows"),
    )
    print(
        "warm-up:",
        summary["warm_up_log"],
        "step marks:",
        [summary[label]["step_marks"] for label in ("baseline", "fault")],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
