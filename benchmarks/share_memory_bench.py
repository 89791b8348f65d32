"""Memory caps of `gpuscope share` on a real GPU, with PyTorch as tenants use it.

One controller holds three tenants: a and b capped at 40% of the card each, c at a fixed 4 GiB.
Phases (each tenant a separate process started with the preload library):

- fill, fill-expandable: a fills its cap with 1 GiB tensors (PyTorch's caching allocator; then with
  expandable_segments, which allocates through cuMemCreate) until PyTorch raises; b runs a matmul
  loop throughout and must not notice (its steps/s before and while a fills).
- view: torch.cuda.mem_get_info() and `nvidia-smi --query-gpu=memory.total,memory.used` inside a.
- sizing: a sizes a KV cache the way vLLM does (profile a forward, then gpu_memory_utilization x total
  less the peak) and runs with it.
- too-big: c (4 GiB) loads a Llama-shaped Hugging Face model of about 6 GB: PyTorch's OOM, no crash.
- alloc-loop: with PyTorch's caching off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) a loop of small tensor
  allocations and frees, without the library and as tenant a, in interleaved paired rounds.
- unmanaged: a process started without the library is seen by the controller; how long it took.

Usage (a GPU host, the preload library built):
    PYTHONPATH=src python benchmarks/share_memory_bench.py --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import logger, percentile, rnd, write_json  # noqa: E402
from share_bench import ROOT, Controller, _lib  # noqa: E402

LEDGER = "/dev/shm/gpuscope-share-memory-bench"
SHARES = "a=0.4:0:0.4,b=0.4:0:0.4,c=0.2:0:4GiB"
GiB = 2**30
log = logger("share-memory")


# --------------------------------------------------------------------------------------------------
# Workers (separate processes; each prints one JSON line)

def work_fill(seconds: str) -> dict:
    import torch

    torch.empty(1, device="cuda")  # the context first: the fill's window starts after it
    held, started = [], time.time()
    error = None
    try:
        while time.time() - started < float(seconds):
            held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": len(held), "error": error, "mem_get_info": [free, total],
            "reserved_gib": torch.cuda.memory_reserved() / GiB, "fill_start": started,
            "fill_end": time.time()}


def work_matmul(seconds: str) -> dict:
    import torch

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    stamps = []
    end = time.time() + float(seconds)
    while time.time() < end:
        for _ in range(10):
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()
        stamps.append(time.time())
    return {"stamps": stamps}


def work_view() -> dict:
    import torch

    free, total = torch.cuda.mem_get_info()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,memory.used",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return {"mem_get_info": [free, total], "nvidia_smi": smi.stdout.strip(),
            "nvidia_smi_rc": smi.returncode}


def work_sizing() -> dict:
    """vLLM's start-up: weights, a profile forward at the largest batch, then KV cache =
    utilization x total - peak; then serve a few steps with that cache."""
    import torch

    utilization = 0.9
    layer = torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True)
    layers = torch.nn.TransformerEncoder(layer, 8)
    model = layers.to("cuda", torch.bfloat16).eval()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(torch.randn(64, 1024, 2048, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()  # as vLLM does after its profile run
    free, total = torch.cuda.mem_get_info()
    kv_bytes = int(utilization * total - peak)
    error = None
    try:
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
        with torch.no_grad():
            for _ in range(5):
                model(torch.randn(64, 1024, 2048, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        del kv
    except torch.OutOfMemoryError as exc:
        error = str(exc).splitlines()[0][:200]
    return {"total": total, "free_after_profile": free, "peak": peak, "kv_cache_bytes": kv_bytes,
            "error": error}


def work_too_big() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=32000)
    error = None
    try:
        with torch.device("cuda"):
            torch.set_default_dtype(torch.bfloat16)
            LlamaForCausalLM(config)
    except torch.OutOfMemoryError as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters()) if error is None else None
    return {"error": error, "params": params, "allocated": torch.cuda.memory_allocated()}


def work_alloc_loop(seconds: str) -> dict:
    import torch

    torch.empty(1, device="cuda")
    end_warm = time.time() + 0.5
    while time.time() < end_warm:
        torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < float(seconds):
        tensors = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(32)]
        del tensors
        n += 32
    torch.cuda.synchronize()
    return {"allocs_per_s": n / (time.perf_counter() - start)}


def work_hold(seconds: str) -> dict:
    import torch

    x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    print(json.dumps({"on_gpu_at": time.time()}), flush=True)
    time.sleep(float(seconds))
    del x
    return {}


WORKERS = {"fill": work_fill, "matmul": work_matmul, "view": work_view, "sizing": work_sizing,
           "too-big": work_too_big, "alloc-loop": work_alloc_loop, "hold": work_hold}


# --------------------------------------------------------------------------------------------------
# Orchestration

def spawn(role: str, *args: str, tenant: str | None,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF")}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    env.update(extra_env or {})
    if tenant:
        env.update(LD_PRELOAD=_lib(), GPUSCOPE_SHARE_TENANT=tenant, GPUSCOPE_SHARE_LEDGER=LEDGER)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", role, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(p: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = p.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    res = json.loads(lines[-1]) if lines else {}
    res["rc"] = p.returncode
    if p.returncode != 0:
        res["stderr"] = err[-1500:]
    return res


def run(role: str, *args: str, tenant: str | None, extra_env: dict[str, str] | None = None) -> dict:
    return result(spawn(role, *args, tenant=tenant, extra_env=extra_env))


def metric(port: int, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
    except OSError:
        return None
    return None


def steps_per_s(stamps: list[float], lo: float, hi: float) -> float:
    inside = [t for t in stamps if lo <= t < hi]
    return len(inside) / max(1e-9, hi - lo)


def phase_fill(expandable: bool) -> dict:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if expandable else {}
    neighbour = spawn("matmul", "16", tenant="b")
    time.sleep(6)  # b alone for a while (its import and warm-up first), then a fills its cap beside it
    filler = run("fill", "60", tenant="a", extra_env=env)
    b = result(neighbour)
    stamps = b.pop("stamps", [])
    filling_from, filling_to = filler.get("fill_start", 0), filler.get("fill_end", 0)
    before = steps_per_s(stamps, stamps[0], filling_from) if stamps and stamps[0] < filling_from else 0
    during = steps_per_s(stamps, filling_from, max(filling_to, filling_from + 0.5))
    return {"a": filler, "b_rc": b["rc"], "b_error": b.get("stderr"), "b_steps_per_s_before": rnd(before),
            "b_steps_per_s_while_a_fills": rnd(during), "b_ratio": rnd(during / before if before else None)}


def phase_alloc_loop(rounds: int, seconds: float) -> dict:
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    ratios, plain_rates, tenant_rates = [], [], []
    for i in range(rounds):
        order = [None, "a"] if i % 2 == 0 else ["a", None]
        rates = {}
        for tenant in order:
            rates[tenant] = run("alloc-loop", str(seconds), tenant=tenant, extra_env=env).get("allocs_per_s")
        if rates[None] and rates["a"]:
            ratios.append(rates["a"] / rates[None])
            plain_rates.append(rates[None])
            tenant_rates.append(rates["a"])
        log(f"alloc-loop round {i + 1}/{rounds}: plain {rates[None]}, tenant {rates['a']}")
    return {"rounds": len(ratios), "ratio_median": rnd(statistics.median(ratios)) if ratios else None,
            "ratio_q1": rnd(percentile(ratios, 25)) if ratios else None,
            "ratio_q3": rnd(percentile(ratios, 75)) if ratios else None,
            "plain_allocs_per_s_median": rnd(statistics.median(plain_rates), 0) if plain_rates else None,
            "tenant_allocs_per_s_median": rnd(statistics.median(tenant_rates), 0) if tenant_rates else None}


def phase_unmanaged(port: int) -> dict:
    holder = spawn("hold", "20", tenant=None)
    on_gpu_at = json.loads(holder.stdout.readline() or "{}").get("on_gpu_at")
    seen_after = None
    while on_gpu_at and time.time() - on_gpu_at < 15:
        if (metric(port, "gpuscope_share_unmanaged_processes") or 0) >= 1:
            seen_after = time.time() - on_gpu_at
            break
        time.sleep(0.05)
    held = metric(port, "gpuscope_share_unmanaged_memory_bytes")
    holder.kill()
    holder.communicate()
    return {"seen_after_s": rnd(seen_after), "unmanaged_memory_bytes": held, "watch_interval_s": 0.5,
            "note": "from its first allocation on the GPU to the controller's /metrics showing it"}


def main_bench(args: argparse.Namespace) -> dict:
    out: dict = {"shares": SHARES, "date": time.strftime("%Y-%m-%d")}

    def save() -> None:
        write_json(args.out, out, indent=1)

    controller = Controller(SHARES, "events", args.port, "--share.watch-interval", "0.5s", ledger=LEDGER)
    try:
        phases = args.phases.split(",")
        for name in phases:
            log(f"phase {name}")
            if name == "fill":
                out[name] = phase_fill(expandable=False)
            elif name == "fill-expandable":
                out[name] = phase_fill(expandable=True)
            elif name == "view":
                out[name] = run("view", tenant="a")
                out[name]["plain"] = run("view", tenant=None)
            elif name == "sizing":
                out[name] = run("sizing", tenant="a")
            elif name == "too-big":
                out[name] = run("too-big", tenant="c")
            elif name == "alloc-loop":
                out[name] = phase_alloc_loop(args.rounds, args.loop_seconds)
            elif name == "unmanaged":
                out[name] = phase_unmanaged(args.port)
            log(json.dumps(out[name])[:600])
            save()
    finally:
        out["controller"] = controller.stop()
        save()
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        print(json.dumps(WORKERS[sys.argv[2]](*sys.argv[3:])), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=9491)
    p.add_argument("--phases", default="view,fill,fill-expandable,sizing,too-big,unmanaged,alloc-loop")
    p.add_argument("--rounds", type=int, default=6, help="alloc-loop: paired rounds")
    p.add_argument("--loop-seconds", type=float, default=2.0)
    args = p.parse_args()
    out = main_bench(args)
    print(json.dumps({k: v for k, v in out.items() if k != "controller"}, indent=1))


if __name__ == "__main__":
    main()
