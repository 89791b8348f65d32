#!/usr/bin/env python3
"""`gpuscope serve --model.hf` on a TinyLlama-shaped model: throughput, TTFT and the cost of timing.

Three parts, each a JSON section; a part that fails records ``{"error": ...}`` and the run exits 1,
naming it on stderr, in the table and under ``failures``:

1. ``model``: a Llama with TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads,
   intermediate 5632, vocab 32000) and random weights, saved in bfloat16 to a temporary folder with a
   tokenizer made offline (byte-level BPE: the 256 byte symbols, then letter/digit pairs and triples up
   to the vocabulary size; prompts encode one token per byte and every id decodes to text).
   ``--quick``: 2 layers, hidden 64, float32: a CPU smoke size.
2. ``concurrency``: ``gpuscope serve --model.hf DIR --timing budget`` as a child process on
   127.0.0.1; for 1, 8 and 32 concurrent streams (``--streams``), each stream sends
   ``--requests-per-stream`` streaming greedy completions back to back (``--prompt-tokens`` tokens in,
   ``--max-tokens`` out). Per level: completion tokens/s, TTFT p50/p99 (to the first SSE chunk), e2e
   p50, and the mean decode batch rows from the server's ``gpuscope_batch_size``.
3. ``timing``: three servers at once, ``--timing off``, ``budget`` and ``all``; ``--rounds`` rounds of
   the same ``--timing-streams``-stream load against each, the order rotated every round (interleaved
   paired rounds: the host's drift hits all three alike). Per mode: median tokens/s; per timed mode:
   median, min and max of its tokens/s over ``off``'s in the same round, and whether its /metrics
   carries the per-module regions (``op="model.layers.0.self_attn"``...).

Needs only torch, transformers, tokenizers, aiohttp, prometheus-client, nvidia-ml-py and pyyaml
(gpuscope comes from ``src/`` by path). Writes ``--out`` (default the current H200 result,
``benchmarks/results/hf-serve-h200.json``), progress on stderr, a table last.

    python benchmarks/hf_serve_bench.py --out benchmarks/results/hf-serve-h200.json   # GPU host, ~4 min
    python benchmarks/hf_serve_bench.py --quick --out /tmp/hf.json                     # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import string
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from benchlib import logger, rnd, utc_now, write_json  # noqa: E402

from gpuscope.loadtest.serverproc import ServerProcess  # noqa: E402

PARTS = ("model", "concurrency", "timing")
MODES = ("off", "budget", "all")
TINYLLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}
QUICK = {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}
MODULE_OP = 'op="model.layers.0.self_attn"'


log = logger("hf_serve_bench")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# --- part 1: the model ----------------------------------------------------------------------------


def build_tokenizer(vocab_size: int):
    """Byte-level BPE without merges: a prompt is one token per byte; every id decodes to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    symbols = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    chars = string.ascii_letters + string.digits
    words = ("".join(t) for n in (2, 3) for t in itertools.product(chars, repeat=n))
    symbols += list(itertools.islice(words, vocab_size - len(symbols)))
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_model(folder: Path, quick: bool) -> dict[str, Any]:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    shape = QUICK if quick else TINYLLAMA
    dtype = torch.float32 if quick else torch.bfloat16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.1B parameters is much faster on the GPU
        model = LlamaForCausalLM(config)
    model = model.to(dtype)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    build_tokenizer(shape["vocab_size"]).save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in folder.iterdir())
    return {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "parameters": params,
            "folder_bytes": size, "built_on": str(device), "wall_s": rnd(time.perf_counter() - started, 1)}


# --- serving ----------------------------------------------------------------------------------------


class Server(ServerProcess):
    """``gpuscope serve --model.hf`` as a child process; its output goes to a file (shown on failure).
    Launched at once: the servers of every mode load together, each is waited for when needed."""

    def __init__(self, folder: Path, timing: str, args: argparse.Namespace, workdir: Path) -> None:
        self.timing = timing
        batch = max(max(args.streams), args.timing_streams)
        env = {"PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p), "HF_HUB_OFFLINE": "1"}
        if not torch.cuda.is_available():
            # Three CPU servers share the host: torch's per-process thread pools would oversubscribe it
            # (a spinning pool on a busy host makes a step 10-100x slower).
            env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
        super().__init__(["--model.hf", str(folder), "--timing", timing,
                          "--batch.max-size", str(batch), "--queue.max-per-tenant", str(4 * batch),
                          "--model.context", str(args.context), "--request.max-tokens", str(args.max_tokens),
                          "--log.level", "warning", *args.server_arg],
                         log_path=workdir / f"serve-{timing}.log", env=env,
                         name=f"`gpuscope serve --timing {timing}`")
        self.started = time.perf_counter()
        self.launch()
        self.ready_s: float | None = None

    def wait_ready(self, timeout_s: float | None = None) -> Server:
        super().wait_ready(timeout_s)
        self.ready_s = rnd(time.perf_counter() - self.started, 1)
        return self

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)


def batch_rows(exposition: str) -> tuple[float, float]:
    """(sum, count) of the decode batch-size histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.labels.get("phase") == "decode" and s.name == "gpuscope_batch_size_sum":
                total = s.value
            elif s.labels.get("phase") == "decode" and s.name == "gpuscope_batch_size_count":
                count = s.value
    return total, count


def prompt_text(index: int, length: int) -> str:
    """A distinct printable prompt of ``length`` bytes (one token each with this tokenizer, plus BOS)."""
    letters = string.ascii_lowercase + " "
    state = index * 2654435761 % (1 << 32) or 1
    out = []
    for _ in range(length):
        state = state * 1103515245 + 12345 & 0x7FFFFFFF
        out.append(letters[state % len(letters)])
    return "".join(out)


async def completion(session, url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streaming greedy completion: TTFT (first SSE chunk), e2e, completion tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    ttft = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error'].get('message')}")
            if ttft is None:
                ttft = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"ttft": ttft if ttft is not None else float("nan"), "e2e": time.perf_counter() - started,
            "tokens": tokens}


async def load(url: str, streams: int, per_stream: int, prompt_tokens: int, max_tokens: int,
               seed: int) -> dict[str, Any]:
    """``streams`` closed-loop clients, ``per_stream`` requests each."""
    import aiohttp

    results: list[dict[str, float]] = []
    errors: list[str] = []

    async def client(session, stream: int) -> None:
        for i in range(per_stream):
            try:
                results.append(await completion(session, url, prompt_text(seed + stream * 1000 + i,
                                                                           prompt_tokens - 1), max_tokens))
            except Exception as exc:  # counted; a run with errors fails its part
                errors.append(f"{type(exc).__name__}: {exc}")

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=streams + 4)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session, s) for s in range(streams)))
        wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if math.isfinite(r["ttft"])]
    return {"streams": streams, "requests": len(results), "errors": len(errors), "first_error": errors[:1],
            "completion_tokens": tokens, "wall_s": rnd(wall, 2), "tokens_per_s": rnd(tokens / wall, 1),
            "ttft_p50_ms": rnd((pct(ttfts, 50) or float("nan")) * 1e3, 1),
            "ttft_p99_ms": rnd((pct(ttfts, 99) or float("nan")) * 1e3, 1),
            "e2e_p50_ms": rnd((pct([r["e2e"] for r in results], 50) or float("nan")) * 1e3, 1)}


def run_load(server: Server, streams: int, per_stream: int, args: argparse.Namespace, seed: int) -> dict:
    before = batch_rows(server.metrics())
    result = asyncio.run(load(server.url, streams, per_stream, args.prompt_tokens, args.max_tokens, seed))
    after = batch_rows(server.metrics())
    steps = after[1] - before[1]
    result["decode_steps"] = int(steps)
    result["mean_decode_batch_rows"] = rnd((after[0] - before[0]) / steps, 2) if steps else None
    if result["errors"]:
        raise RuntimeError(f"{result['errors']} of {streams * per_stream} requests failed at {streams} "
                           f"streams: {result['first_error'][0]}")
    return result


# --- parts 2 and 3 ------------------------------------------------------------------------------------


def part_concurrency(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    log(f"concurrency: warm-up ({max(args.streams)} streams, 1 request each)")
    run_load(server, max(args.streams), 1, args, seed=10_000)
    levels = {}
    for streams in args.streams:
        log(f"concurrency: {streams} stream(s) x {args.requests_per_stream} request(s)")
        levels[str(streams)] = run_load(server, streams, args.requests_per_stream, args, seed=streams * 100)
        level = levels[str(streams)]
        log(f"  {level['tokens_per_s']} tok/s, TTFT p50 {level['ttft_p50_ms']} ms "
            f"p99 {level['ttft_p99_ms']} ms, mean decode rows {level['mean_decode_batch_rows']}")
    return {"server": " ".join(server.command()[2:]), "timing": server.timing, "levels": levels}


def part_timing(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, Any]:
    for mode, server in servers.items():
        log(f"timing: warm-up of --timing {mode}")
        run_load(server, args.timing_streams, 1, args, seed=20_000)
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = MODES[r % 3:] + MODES[: r % 3]
        row = {}
        for mode in order:
            row[mode] = run_load(servers[mode], args.timing_streams, args.timing_requests, args,
                                 seed=30_000 + r)["tokens_per_s"]
        rounds.append(row)
        log(f"timing: round {r + 1}/{args.rounds} (order {', '.join(order)}): "
            + ", ".join(f"{m} {row[m]} tok/s" for m in MODES))
    modes: dict[str, Any] = {}
    for mode in MODES:
        values = [row[mode] for row in rounds]
        modes[mode] = {"tokens_per_s_median": rnd(statistics.median(values), 1), "tokens_per_s": values}
        if mode != "off":
            ratios = [row[mode] / row["off"] for row in rounds if row["off"]]
            modes[mode]["ratio_to_off"] = {"median": rnd(statistics.median(ratios)), "min": rnd(min(ratios)),
                                           "max": rnd(max(ratios))}
            modes[mode]["throughput_cost_pct_median"] = rnd((1 - statistics.median(ratios)) * 100, 2)
        text = servers[mode].metrics()
        modes[mode]["per_module_regions"] = MODULE_OP in text
        modes[mode]["module_ops"] = sorted({line.split('op="')[1].split('"')[0] for line in text.splitlines()
                                            if line.startswith("gpuscope_region_gpu_seconds_count")
                                            and 'op="' in line} - {"prefill", "decode"})[:6]
    if modes["off"]["per_module_regions"]:
        raise RuntimeError("--timing off exposes per-module regions")
    for mode in ("budget", "all"):
        if not modes[mode]["per_module_regions"]:
            raise RuntimeError(f"--timing {mode}: no per-module region ({MODULE_OP}) on /metrics")
    return {"streams": args.timing_streams, "requests_per_stream": args.timing_requests, "rounds": rounds,
            "modes": modes}


# --- report -----------------------------------------------------------------------------------------


def table(report: dict) -> str:
    rows = [("device", report["device"]), ("model", report["model_shape"])]
    for name, part in report["parts"].items():
        if "error" in part:
            rows.append((f"part {name}", "error: " + part["error"].splitlines()[0]))
    conc = report["parts"].get("concurrency", {})
    for streams, level in conc.get("levels", {}).items():
        rows.append((f"{streams:>2} stream(s): tok/s | TTFT p50/p99 ms | decode rows",
                     f"{level['tokens_per_s']} | {level['ttft_p50_ms']} / {level['ttft_p99_ms']} | "
                     f"{level['mean_decode_batch_rows']}"))
    timing = report["parts"].get("timing", {})
    for mode, result in timing.get("modes", {}).items():
        extra = ""
        if "ratio_to_off" in result:
            ratio = result["ratio_to_off"]
            extra = f" | x off: {ratio['median']} ({ratio['min']}-{ratio['max']}), modules timed: " \
                    f"{result['per_module_regions']}"
        rows.append((f"--timing {mode}: tok/s median", f"{result['tokens_per_s_median']}{extra}"))
    rows += [("FAILED", failure) for failure in report["failures"]]
    rows.append(("written", report["out"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short loads: a CPU smoke run")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/hf-serve-h200.json"), help="JSON path")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated subset of " + ",".join(PARTS) + " (model always runs)")
    p.add_argument("--streams", help="concurrency levels (1,8,32; quick 1,4)")
    p.add_argument("--requests-per-stream", type=int, help="requests per stream and level (4; quick 2)")
    p.add_argument("--prompt-tokens", type=int, help="prompt tokens incl. BOS (128; quick 16)")
    p.add_argument("--max-tokens", type=int, help="completion tokens per request (128; quick 8)")
    p.add_argument("--context", type=int, default=512, help="--model.context of the servers")
    p.add_argument("--timing-streams", type=int, help="streams of the timing part's load (8; quick 2)")
    p.add_argument("--timing-requests", type=int, help="requests per stream per mode and round (2; quick 1)")
    p.add_argument("--rounds", type=int, help="interleaved rounds of off/budget/all (12; quick 2)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to load")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `gpuscope serve` flag (repeatable)")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {"streams": "1,4" if quick else "1,8,32", "requests_per_stream": 2 if quick else 4,
                "prompt_tokens": 16 if quick else 128, "max_tokens": 8 if quick else 128,
                "timing_streams": 2 if quick else 8, "timing_requests": 1 if quick else 2,
                "rounds": 2 if quick else 12}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.streams = [int(s) for s in str(args.streams).split(",") if s.strip()]
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    if "model" not in args.parts:
        args.parts.insert(0, "model")  # the other parts serve the model it builds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "date": utc_now(), "device": device,
        "torch": torch.__version__, "transformers": transformers.__version__, "quick": args.quick,
        "model_shape": "quick (2 layers, hidden 64)" if args.quick else "TinyLlama-1.1B (random weights)",
        "load": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "temperature": 0,
                 "streams": args.streams, "requests_per_stream": args.requests_per_stream},
        "parts": {}, "failures": [], "out": args.out}
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="hf-serve-bench-") as tmp:
        folder = Path(tmp) / "tinyllama-random"
        folder.mkdir()
        try:
            for name in args.parts:
                started = time.perf_counter()
                log(f"part {name}")
                try:
                    if name == "model":
                        report["parts"]["model"] = build_model(folder, args.quick)
                        continue
                    if "error" in report["parts"]["model"]:
                        raise RuntimeError("no model to serve (part model failed)")
                    if not servers:  # every server the parts need, loading at once
                        needed = [m for m in MODES if "timing" in args.parts
                                  or (m == "budget" and "concurrency" in args.parts)]
                        servers.update((m, Server(folder, m, args, Path(tmp))) for m in needed)
                    wanted = MODES if name == "timing" else ("budget",)
                    for mode in wanted:
                        servers[mode].wait_ready(args.ready_timeout)
                        log(f"--timing {mode} server ready after {servers[mode].ready_s}s")
                    if name == "concurrency":
                        report["parts"][name] = part_concurrency(servers["budget"], args)
                    else:
                        report["parts"][name] = part_timing({m: servers[m] for m in MODES}, args)
                    report["parts"][name]["wall_s"] = rnd(time.perf_counter() - started, 1)
                except Exception as exc:
                    message = f"{type(exc).__name__}: {exc}"
                    report["parts"][name] = {"error": message, "traceback": traceback.format_exc()}
                    report["failures"].append(f"{name}: {message}")
                    log(f"FAILED {name}: {message}")
        finally:
            for server in servers.values():
                server.stop()
    write_json(args.out, report)
    print(table(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
