#!/usr/bin/env python3
"""Time to first token as clients see it against what the server records, under 32 streams.

``gpuscope serve --model.hf`` on a TinyLlama-shaped model with random weights (``hf_serve_bench``'s
model and tokenizer) as a child process on 127.0.0.1; then ``--rounds`` paired rounds, the order
alternating, each ``--duration`` seconds of ``--streams`` closed-loop streaming chat clients:

- ``openai``: the official ``openai`` client (``AsyncOpenAI``), as users measure TTFT: from calling
  ``chat.completions.create(stream=True)`` to the first chunk with non-empty ``delta.content``;
- ``raw``: the same requests from a bare aiohttp client that only splits SSE lines and reads the
  first non-empty content, to tell the openai client's own cost from the server's.

Each round waits for its last request, so the server's histograms between the scrapes before and
after a round hold exactly that round's requests. Per round: client TTFT (mean, p50, p99), the
server's ``gpuscope_request_ttft_seconds`` mean (sum/count deltas: the first non-empty text written),
``gpuscope_request_engine_ttft_seconds`` mean (the sampling step: vLLM's TTFT), the event loop's lag
and the engine-to-loop delivery (means, and the share of samples over 5 ms), and the request counts of
both sides (they must match). The target: the server's TTFT mean within 10 % (or 5 ms) of the openai
client's, per round.

    python benchmarks/client_ttft_bench.py --out benchmarks/results/client-ttft-h200-DATE.json   # GPU
    python benchmarks/client_ttft_bench.py --quick --streams 4 --duration 5 --out /tmp/ttft.json  # CPU
    ... --client-processes 4   # also the openai client over 4 processes (its own load apart)

Needs torch, transformers, tokenizers, aiohttp, prometheus-client and openai.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from benchlib import logger, rnd, utc_now, write_json  # noqa: E402
from hf_serve_bench import build_model, pct, prompt_text  # noqa: E402

from gpuscope.loadtest.serverproc import ServerProcess  # noqa: E402

log = logger("client_ttft_bench")
CLIENTS = ("openai", "raw")
#: With --client-processes N > 1, a third client: the openai client's streams spread over N processes.
SPLIT = "openai-split"
SERIES = {"ttft": "gpuscope_request_ttft_seconds", "engine_ttft": "gpuscope_request_engine_ttft_seconds",
          "loop_lag": "gpuscope_event_loop_lag_seconds", "delivery": "gpuscope_event_delivery_seconds"}
SLOW_S = 0.005


def scrape(url: str) -> dict[str, dict[str, float]]:
    """Per series: sum, count and the cumulative count at or under 5 ms (all tenants added)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {key: {"sum": 0.0, "count": 0.0, "fast": 0.0} for key in SERIES}
    names = {v: k for k, v in SERIES.items()}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        if key is None:
            continue
        for s in family.samples:
            if s.name.endswith("_sum"):
                out[key]["sum"] += s.value
            elif s.name.endswith("_count"):
                out[key]["count"] += s.value
            elif s.name.endswith("_bucket") and float(s.labels["le"]) == SLOW_S:
                out[key]["fast"] += s.value
    return out


def delta(before: dict, after: dict) -> dict[str, Any]:
    result = {}
    for key in SERIES:
        count = after[key]["count"] - before[key]["count"]
        total = after[key]["sum"] - before[key]["sum"]
        fast = after[key]["fast"] - before[key]["fast"]
        result[key] = {"count": int(count), "mean_ms": rnd(total / count * 1e3, 2) if count else None,
                       "over_5ms_share": rnd((count - fast) / count, 4) if count else None}
    return result


# --- the two clients ---------------------------------------------------------------------------------


class LoopLag:
    """The client's own event-loop lag while a round runs: a busy client delays reading first chunks."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self.samples = interval, []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.samples.append(loop.time() - due)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def summary(self) -> dict[str, Any]:
        s = self.samples
        return {"samples": len(s), "mean_ms": rnd(statistics.fmean(s) * 1e3, 2) if s else None,
                "p99_ms": rnd((pct(s, 99) or math.nan) * 1e3, 2)}


def chat_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


async def openai_round(url: str, model: str, args: argparse.Namespace, seed: int) -> list[dict]:
    from openai import AsyncOpenAI

    # The client's default pool (up to 1000 connections, 100 kept alive) covers the streams.
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    results: list[dict] = []
    deadline = time.perf_counter() + args.duration

    async def stream(n: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            body = chat_body(model, prompt_text(seed + n * 10007 + i, args.prompt_chars), args.max_tokens)
            started = time.perf_counter()
            first = None
            response = await client.chat.completions.create(
                model=model, messages=body["messages"], max_tokens=args.max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            async for chunk in response:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
            results.append({"ttft": first, "e2e": time.perf_counter() - started})
            i += 1

    try:
        with LoopLag() as lag:
            await asyncio.gather(*(stream(n) for n in range(args.streams)))
    finally:
        await client.close()
    return [*results, {"client_loop_lag": lag.summary()}]


async def raw_round(url: str, model: str, args: argparse.Namespace, seed: int) -> list[dict]:
    import aiohttp

    results: list[dict] = []
    deadline = time.perf_counter() + args.duration
    connector = aiohttp.TCPConnector(limit=args.streams + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def stream(n: int) -> None:
            i = 0
            while time.perf_counter() < deadline:
                body = chat_body(model, prompt_text(seed + n * 10007 + i, args.prompt_chars), args.max_tokens)
                body["stream"] = True
                started = time.perf_counter()
                first = None
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
                    async for line in response.content:
                        if first is None and line.startswith(b"data: {") and b'"content": "' in line \
                                and b'"content": ""' not in line:
                            first = time.perf_counter() - started
                results.append({"ttft": first, "e2e": time.perf_counter() - started})
                i += 1

        with LoopLag() as lag:
            await asyncio.gather(*(stream(n) for n in range(args.streams)))
    return [*results, {"client_loop_lag": lag.summary()}]


def _openai_part(url: str, model: str, args: argparse.Namespace, seed: int) -> list[dict]:
    return asyncio.run(openai_round(url, model, args, seed))


def split_round(url: str, model: str, args: argparse.Namespace, seed: int) -> list[dict]:
    """The openai client's streams over ``--client-processes`` processes (same prompts, same duration):
    how much of its gap is one process's own load."""
    from concurrent.futures import ProcessPoolExecutor

    n = args.client_processes
    shares = [args.streams // n + (1 if i < args.streams % n else 0) for i in range(n)]
    with ProcessPoolExecutor(n) as pool:
        futures = [pool.submit(_openai_part, url, model,
                               argparse.Namespace(**{**vars(args), "streams": share}), seed + 10007 * first)
                   for share, first in zip(shares, [sum(shares[:i]) for i in range(n)], strict=True) if share]
        parts = [f.result() for f in futures]
    lags = [part.pop()["client_loop_lag"] for part in parts]
    merged = [r for part in parts for r in part]
    means = [lag["mean_ms"] for lag in lags if lag["mean_ms"] is not None]
    lag = {"samples": sum(lag["samples"] for lag in lags), "processes": len(parts),
           "mean_ms": rnd(statistics.fmean(means), 2) if means else None,
           "p99_ms": max((lag["p99_ms"] for lag in lags), default=None)}
    return [*merged, {"client_loop_lag": lag}]


def summary(results: list[dict]) -> dict[str, Any]:
    lag = results.pop()["client_loop_lag"]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"requests": len(results), "with_text": len(ttfts),
            "ttft_mean_ms": rnd(statistics.fmean(ttfts) * 1e3, 2) if ttfts else None,
            "ttft_p50_ms": rnd((pct(ttfts, 50) or math.nan) * 1e3, 2),
            "ttft_p99_ms": rnd((pct(ttfts, 99) or math.nan) * 1e3, 2),
            "e2e_mean_ms": rnd(statistics.fmean(r["e2e"] for r in results) * 1e3, 1) if results else None,
            "client_loop_lag": lag}


def verdict(client_ms: float | None, server_ms: float | None) -> dict[str, Any]:
    if client_ms is None or server_ms is None:
        return {"gap_ms": None, "gap_share": None, "met": False}
    gap = client_ms - server_ms
    return {"gap_ms": rnd(gap, 2), "gap_share": rnd(gap / client_ms, 4),
            "met": abs(gap) <= max(0.10 * client_ms, 5.0)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"date": utc_now(),
                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                              "quick": args.quick, "streams": args.streams, "duration_s": args.duration,
                              "rounds": args.rounds, "prompt_chars": args.prompt_chars,
                              "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory(prefix="client-ttft-") as tmp:
        folder = Path(tmp) / "tinyllama-random"
        folder.mkdir()
        report["model"] = build_model(folder, args.quick)
        log(f"model built in {report['model']['wall_s']} s")
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                             if p), "HF_HUB_OFFLINE": "1"}
        server = ServerProcess(["--model.hf", str(folder), "--batch.max-size", str(args.streams),
                                "--queue.max-per-tenant", str(4 * args.streams), "--model.context", "1024",
                                "--request.max-tokens", str(args.max_tokens), "--log.level", "warning"],
                               log_path=Path(tmp) / "serve.log", env=env, ready_timeout_s=300)
        server.start()
        try:
            model = "tinyllama-random"
            warm = argparse.Namespace(**{**vars(args), "duration": 1.0})
            asyncio.run(raw_round(server.url, model, warm, 7))  # the model's first shapes
            asyncio.run(openai_round(server.url, model, warm, 7))  # the client's imports and first parses
            rounds = []
            for r in range(args.rounds):
                clients = (*CLIENTS, SPLIT) if args.client_processes > 1 else CLIENTS
                for name in (clients if r % 2 == 0 else clients[::-1]):
                    before = scrape(server.url)
                    if name == SPLIT:
                        results = split_round(server.url, model, args, seed=1000 * r)
                    else:
                        fn = openai_round if name == "openai" else raw_round
                        results = asyncio.run(fn(server.url, model, args, seed=1000 * r))
                    after = scrape(server.url)
                    row = {"round": r, "client": name, **summary(results), "server": delta(before, after)}
                    row.update(verdict(row["ttft_mean_ms"], row["server"]["ttft"]["mean_ms"]))
                    rounds.append(row)
                    server_ms = row["server"]["ttft"]["mean_ms"]
                    engine_ms = row["server"]["engine_ttft"]["mean_ms"]
                    log(f"round {r} {name}: client {row['ttft_mean_ms']} ms, server {server_ms} ms, "
                        f"engine {engine_ms} ms, {row['requests']} requests")
            report["rounds"] = rounds
        finally:
            server.stop()
    report["target"] = "server TTFT mean within 10% (or 5 ms) of the openai client's, every openai round"
    report["client_processes"] = args.client_processes
    report["target_met"] = all(r["met"] for r in report["rounds"] if r["client"] == "openai")
    return report


def table(report: dict) -> str:
    lines = [f"{'round':>5} {'client':>12} {'reqs':>5} {'client ms':>10} {'server ms':>10} {'engine ms':>10} "
             f"{'gap ms':>7} {'gap %':>6} {'lag ms':>7} {'deliv ms':>8} {'cl lag':>7} met"]
    for r in report["rounds"]:
        s = r["server"]
        lines.append(f"{r['round']:>5} {r['client']:>12} {r['requests']:>5} {r['ttft_mean_ms']!s:>10} "
                     f"{s['ttft']['mean_ms']!s:>10} {s['engine_ttft']['mean_ms']!s:>10} {r['gap_ms']!s:>7} "
                     f"{rnd((r['gap_share'] or 0) * 100, 1)!s:>6} {s['loop_lag']['mean_ms']!s:>7} "
                     f"{s['delivery']['mean_ms']!s:>8} {r['client_loop_lag']['mean_ms']!s:>7} {r['met']}")
    lines.append(f"target met: {report['target_met']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 2-layer float32 model (CPU smoke size)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--duration", type=float, default=12.0, help="seconds of new requests per round")
    p.add_argument("--rounds", type=int, default=2, help="paired rounds (openai and raw each)")
    p.add_argument("--prompt-chars", type=int, default=127, help="prompt bytes (one token each, plus BOS)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--client-processes", type=int, default=1,
                   help="also run the openai client's streams spread over this many processes")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.streams < 1 or args.duration <= 0 or args.rounds < 1 or args.client_processes < 1:
        p.error("--streams, --duration, --rounds and --client-processes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    write_json(args.out, report)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
