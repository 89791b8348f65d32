#!/usr/bin/env python3
"""`gpuscope diagnose` on three induced problems, and joules per output token, on one GPU host.

One `gpuscope serve --model.hf` (TinyLlama-shaped, random weights: hf_serve_bench.build_model) with
tenants alpha and beta serves every part:

1. ``diagnose``: `gpuscope diagnose --duration D --json-file ...` as a child process while a problem
   is induced, its transcript (stdout) and JSON kept; a case passes when the expected finding is
   among the findings and the exit status is 1:
   - ``cpu_bound``: one tokenizer process per core encoding text in a loop, the GPU idle
     (expected ``input_bound``);
   - ``launch_bound``: one stream of greedy decoding (batch 1) against the server
     (expected ``hidden_sync``);
   - ``memory_97``: a process that fills the GPU to 97% and runs matmul bursts on and off
     (expected ``memory_pressure``).
2. ``energy``: idle power first, then for 1, 8 and 32 streams (three quarters of them as tenant alpha,
   a quarter as beta; 1 stream: alpha): NVML's total-energy counter, the server's generation tokens
   and tenant GPU seconds before and after. J/token = energy / tokens (also above idle power), and per
   tenant: energy split by the tenants' GPU seconds, over each tenant's tokens; the same arithmetic as
   the energy recording rules.

    python benchmarks/diagnose_energy_bench.py --out benchmarks/results/diagnose-energy-h200.json
    python benchmarks/diagnose_energy_bench.py --quick --out /tmp/d.json      # CPU smoke (no energy)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hf_serve_bench as hf  # noqa: E402
import torch  # noqa: E402
from benchlib import logger, rnd, utc_now, write_json  # noqa: E402

from gpuscope.loadtest.serverproc import ServerProcess  # noqa: E402

log = logger("diagnose_energy_bench")
CASES = {"cpu_bound": "input_bound", "launch_bound": "hidden_sync", "memory_97": "memory_pressure"}


# --- load ---------------------------------------------------------------------------------------------

async def _stream(session, url: str, tenant: str, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    tokens = 0
    async with session.post(url + "/v1/completions", json=body, headers={"X-Tenant": tenant}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


async def _load(url: str, tenants: list[str], per_stream: int | None, until: float | None, args) -> int:
    import aiohttp

    async def client(i: int, tenant: str) -> int:
        done = n = 0
        while (per_stream is not None and n < per_stream) or (until is not None and time.monotonic() < until):
            done += await _stream(session, url, tenant, hf.prompt_text(i * 1000 + n, args.prompt_tokens - 1),
                                  args.max_tokens)
            n += 1
        return done

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                                     connector=aiohttp.TCPConnector(limit=len(tenants) + 4)) as session:
        return sum(await asyncio.gather(*(client(i, t) for i, t in enumerate(tenants))))


def load(url: str, tenants: list[str], args, per_stream: int | None = None,
         seconds: float | None = None) -> int:
    until = time.monotonic() + seconds if seconds is not None else None
    return asyncio.run(_load(url, tenants, per_stream, until, args))


def server_counters(url: str) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {"tokens": {}, "gpu_seconds": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpuscope_generation_tokens_total":
                out["tokens"][s.labels["tenant"]] = s.value
            elif s.name == "gpuscope_tenant_gpu_seconds_total":
                out["gpu_seconds"][s.labels["tenant"]] = s.value
    return out


# --- energy -------------------------------------------------------------------------------------------

class Energy:
    """NVML's total energy counter of GPU 0 (mJ since the driver loaded), or None on a CPU host."""

    def __init__(self) -> None:
        self.nv = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # a CPU host: the energy part reports it and skips
            self.error = f"{type(exc).__name__}: {exc}"

    def joules(self) -> float | None:
        return None if self.nv is None else self.nv.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0


def part_energy(server: ServerProcess, args, energy: Energy) -> dict[str, Any]:
    if energy.nv is None:
        raise RuntimeError(f"no NVML energy counter: {energy.error}")
    e0, t0 = energy.joules(), time.monotonic()
    time.sleep(args.idle_s)  # measuring idle power is waiting by definition
    idle_w = (energy.joules() - e0) / (time.monotonic() - t0)
    log(f"energy: idle {idle_w:.1f} W")
    load(server.url, ["alpha"] * 8, args, per_stream=1)  # warm-up
    levels = {}
    for streams in args.streams:
        tenants = ["alpha"] if streams == 1 else ["alpha"] * (streams * 3 // 4) + ["beta"] * (streams // 4)
        before, e0, t0 = server_counters(server.url), energy.joules(), time.monotonic()
        load(server.url, tenants, args, per_stream=args.requests_per_stream)
        after, e1, t1 = server_counters(server.url), energy.joules(), time.monotonic()
        joules, wall = e1 - e0, t1 - t0
        tokens = {t: after["tokens"].get(t, 0) - before["tokens"].get(t, 0) for t in after["tokens"]}
        gpu_s = {t: after["gpu_seconds"].get(t, 0) - before["gpu_seconds"].get(t, 0)
                 for t in after["gpu_seconds"]}
        total_tokens, total_gpu_s = sum(tokens.values()), sum(gpu_s.values())
        per_tenant = {}
        for t in sorted(tokens):
            if tokens[t] <= 0:
                continue
            share = gpu_s.get(t, 0) / total_gpu_s if total_gpu_s else 0.0
            per_tenant[t] = {"tokens": int(tokens[t]), "gpu_seconds": rnd(gpu_s.get(t, 0), 3),
                             "gpu_seconds_share": rnd(share, 3), "joules": rnd(joules * share, 1),
                             "joules_per_token": rnd(joules * share / tokens[t], 4)}
        levels[str(streams)] = {
            "streams": streams, "tenants": {t: tenants.count(t) for t in set(tenants)},
            "wall_s": rnd(wall, 2), "tokens": int(total_tokens), "tokens_per_s": rnd(total_tokens / wall, 1),
            "joules": rnd(joules, 1),
            "mean_power_w": rnd(joules / wall, 1), "joules_per_token": rnd(joules / total_tokens, 4),
            "joules_per_token_above_idle": rnd((joules - idle_w * wall) / total_tokens, 4),
            "per_tenant": per_tenant,
        }
        lv = levels[str(streams)]
        log(f"energy: {streams} stream(s): {lv['tokens_per_s']} tok/s, {lv['mean_power_w']} W, "
            f"{lv['joules_per_token']} J/token; tenants " +
            ", ".join(f"{t} {v['joules_per_token']} J/token ({v['gpu_seconds_share']} of GPU s)"
                      for t, v in per_tenant.items()))
    return {"idle_power_w": rnd(idle_w, 1), "levels": levels, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "requests_per_stream": args.requests_per_stream}


# --- induced problems --------------------------------------------------------------------------------

def _tokenize_forever(stop: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = hf.build_tokenizer(32000)
    text = hf.prompt_text(7, 4000)
    while not stop.is_set():
        tok(text)


def _fill_memory(share: float, ready: Any, stop: Any) -> None:
    free, total = torch.cuda.mem_get_info()
    want = int(share * total) - (total - free)
    hog = torch.empty(max(0, want - (1 << 30)), dtype=torch.uint8, device="cuda")  # the matmul's room kept
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ready.set()
    while not stop.is_set():
        until = time.monotonic() + 0.4
        while time.monotonic() < until:  # a burst of work, then none: utilization swings
            a @ a
        torch.cuda.synchronize()
        stop.wait(0.6)
    del hog


def diagnose(server: ServerProcess, args, name: str, workdir: Path) -> dict[str, Any]:
    json_path = workdir / f"{name}.json"
    cmd = [sys.executable, "-m", "gpuscope", "diagnose", "--duration", f"{args.diagnose_s}s",
           "--interval", "0.5s", "--server", server.url + "/metrics", "--json-file", str(json_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.diagnose_s + 60, env=env)
    document = json.loads(json_path.read_text()) if json_path.exists() else {}
    findings = [f["code"] for s in document.get("summaries", []) for f in s["findings"]]
    return {"command": "gpuscope " + " ".join(cmd[3:-2]), "exit_status": proc.returncode,
            "transcript": proc.stdout + proc.stderr, "findings": findings,
            "expected": CASES[name], "diagnosed": CASES[name] in findings and proc.returncode == 1,
            "summary": (document.get("summaries") or [{}])[0].get("summary")}


def part_diagnose(server: ServerProcess, args, workdir: Path) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = {}
    # 1. CPU-bound tokenization: one tokenizer loop per core, nothing for the GPU.
    stop = ctx.Event()
    workers = [ctx.Process(target=_tokenize_forever, args=(stop,)) for _ in range(os.cpu_count() or 2)]
    for w in workers:
        w.start()
    time.sleep(2.0)  # the workers build their tokenizer first
    try:
        out["cpu_bound"] = diagnose(server, args, "cpu_bound", workdir)
    finally:
        stop.set()
        for w in workers:
            w.join(10)
    # 2. Launch-bound batch-1 decode: one stream, back to back, during the whole window.
    import threading

    result: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: result.setdefault(
        "tokens", load(server.url, ["alpha"], args, seconds=args.diagnose_s + 3)))
    loader.start()
    time.sleep(1.5)
    out["launch_bound"] = diagnose(server, args, "launch_bound", workdir)
    loader.join()
    out["launch_bound"]["load_tokens"] = result.get("tokens")
    # 3. Memory at 97% with bursts of work.
    if torch.cuda.is_available():
        stop, ready = ctx.Event(), ctx.Event()
        hog = ctx.Process(target=_fill_memory, args=(args.memory_share, ready, stop))
        hog.start()
        ready.wait(60)
        try:
            out["memory_97"] = diagnose(server, args, "memory_97", workdir)
        finally:
            stop.set()
            hog.join(30)
    for name, case in out.items():
        log(f"diagnose {name}: exit {case['exit_status']}, findings {case['findings']}, expected "
            f"{case['expected']}: {'OK' if case['diagnosed'] else 'MISSED'}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model on CPU: a smoke run")
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--transcripts", default=None,
                   help="folder for the diagnose transcripts (default: beside --out)")
    p.add_argument("--parts", default="diagnose,energy")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--diagnose-s", type=float, default=6.0)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--memory-share", type=float, default=0.97)
    args = p.parse_args(argv)
    args.streams = [int(x) for x in args.streams.split(",")]
    if args.quick:
        args.streams, args.requests_per_stream, args.max_tokens, args.diagnose_s = [1, 4], 1, 8, 2.0
    report: dict[str, Any] = {"date": utc_now(),
                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                              "parts": {}}
    failures = []
    with tempfile.TemporaryDirectory(prefix="diagnose-bench-") as tmp:
        workdir = Path(tmp)
        report["model"] = hf.build_model(workdir / "model", args.quick)
        env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
        server = ServerProcess(["--model.hf", str(workdir / "model"), "--tenants", "alpha:0.5,beta:0.5",
                                "--batch.max-size", "32", "--queue.max-per-tenant", "128",
                                "--model.context", "512", "--request.max-tokens", str(args.max_tokens),
                                "--log.level", "warning"], log_path=workdir / "serve.log", env=env,
                               name="gpuscope serve", ready_timeout_s=600).start()
        report["server"] = " ".join(server.command()[2:])
        energy = Energy()
        try:
            for part in args.parts.split(","):
                try:
                    started = time.perf_counter()
                    if part == "diagnose":
                        report["parts"][part] = part_diagnose(server, args, workdir)
                    else:
                        report["parts"][part] = part_energy(server, args, energy)
                    report["parts"][part]["wall_s"] = rnd(time.perf_counter() - started, 1)
                except Exception as exc:
                    report["parts"][part] = {"error": "".join(traceback.format_exception_only(exc)).strip(),
                                             "traceback": traceback.format_exc()}
                    failures.append(part)
                    log(f"part {part} failed: {exc}")
        finally:
            server.stop()
    report["failures"] = failures
    out = write_json(args.out, report, indent=1)
    folder = Path(args.transcripts) if args.transcripts else out.parent
    for name, case in report["parts"].get("diagnose", {}).items():
        if isinstance(case, dict) and "transcript" in case:
            (folder / f"{out.stem}-{name}.txt").write_text(f"$ {case['command']}\n{case['transcript']}")
    print(json.dumps({k: v for k, v in report["parts"].get("energy", {}).items() if k != "levels"}))
    for streams, lv in report["parts"].get("energy", {}).get("levels", {}).items():
        print(f"{streams:>3} streams: {lv['tokens_per_s']:>8} tok/s {lv['mean_power_w']:>6} W "
              f"{lv['joules_per_token']:>8} J/token ({lv['joules_per_token_above_idle']} above idle) | " +
              ", ".join(f"{t}: {v['joules_per_token']} J/tok, {v['gpu_seconds_share']} of GPU s"
                        for t, v in lv["per_tenant"].items()))
    for name, case in report["parts"].get("diagnose", {}).items():
        if isinstance(case, dict) and "findings" in case:
            print(f"diagnose {name:<13} exit {case['exit_status']} findings {case['findings']} -> "
                  f"{'diagnosed' if case['diagnosed'] else 'MISSED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
