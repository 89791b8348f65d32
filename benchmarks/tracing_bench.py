#!/usr/bin/env python3
"""What request tracing costs `gpuscope serve`: tracing on against off, in interleaved paired rounds.

Two parts, each a JSON section:

1. ``parts`` (in process, no HTTP): the tracer's own calls for ``--batch`` requests decoded together
   for ``--steps`` steps, CPU time on the thread that makes each call:
   - ``loop``: what the event loop pays per request (start the server span, register the request,
     queue it for the builder), against the untraced handler's trace-id code (parse ``traceparent`` or
     make an id, format the response's);
   - ``engine``: what the engine thread pays per step and request (the ``on_step`` observer and the
     step timer's extra callback), against the plain timer's start/stop;
   - ``builder``: CPU of the builder thread per request (the spans built after the request, with
     their step events), read from /proc for that thread;
   - ``encode``: OTLP protobuf encoding of a request's spans (what the exporter thread does per
     export before the HTTP POST).
   ``--repeats`` repetitions; medians.
2. ``served``: two ``gpuscope serve`` child processes on 127.0.0.1, one untraced, one exporting every
   request's spans to an OTLP/HTTP receiver in this process (decoded with opentelemetry-proto and
   counted). ``--pairs`` pairs of rounds, the order flipped each pair; a round is ``--requests``
   non-streaming completions from ``--concurrency`` clients, then ``--settle`` seconds in which the
   traced server builds and exports that round's spans (the untraced one idles as long). Per round:
   the server's CPU seconds per request (utime + stime from /proc/PID/stat: event loop, engine,
   builder and exporter threads together), completion tokens/s and p50 latency over the load window.
   Per pair: on − off CPU µs per request, on/off tokens/s. Medians with quartiles: on a shared machine
   one pair means nothing (docs/design.md, "How overhead is measured").

CPU by default (a busy 2-core VM: the CPU µs are the figure there). On a GPU host, ``--device cuda``
serves a bigger model (``--layers/--dim/--heads``) on the GPU: tokens/s on against off is the figure.
Needs torch, aiohttp and the OpenTelemetry packages (``pip install -e '.[tracing]'``: opentelemetry-sdk,
-exporter-otlp-proto-http, -proto); gpuscope itself comes from src/ by path.

    python benchmarks/tracing_bench.py --out benchmarks/results/tracing-cpu.json
    python benchmarks/tracing_bench.py --device cuda --out benchmarks/results/tracing-h200.json
    python benchmarks/tracing_bench.py --quick --out /tmp/tracing.json     # smoke, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]  # benchmarks/: run through runpy too
from benchlib import logger, utc_now, write_json  # noqa: E402
from benchlib import quartiles as quartiles_of  # noqa: E402

from gpuscope.loadtest.serverproc import ServerError, ServerProcess  # noqa: E402
from gpuscope.server.otlp_sink import OtlpSink  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
NEEDED = {"opentelemetry.sdk": "opentelemetry-sdk",
          "opentelemetry.exporter.otlp.proto.http": "opentelemetry-exporter-otlp-proto-http",
          "opentelemetry.proto": "opentelemetry-proto", "aiohttp": "aiohttp", "torch": "torch"}


def require_packages() -> None:
    missing = []
    for module, package in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        sys.stderr.write(f"tracing_bench: missing Python packages: {', '.join(missing)}. Tracing needs "
                         "opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http and opentelemetry-proto "
                         "(pip install -e '.[tracing]' in this repository, or the wheels); the server needs "
                         "torch and aiohttp.\n")
        raise SystemExit(2)


log = logger("tracing_bench")


def quartiles(values: list[float]) -> dict:
    if len(values) < 2:
        return {"median": values[0] if values else None, "q1": None, "q3": None, "n": len(values)}
    q1, median, q3 = quartiles_of(values)
    return {"median": median, "q1": q1, "q3": q3, "n": len(values), "min": min(values), "max": max(values)}


def thread_cpu(native_id: int) -> float:
    """CPU seconds of one thread of this process (Linux: /proc/self/task/<tid>/stat)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


# --- part 1: the tracer's calls, in process ----------------------------------------------------------

def measure_parts(requests_n: int, batch: int, steps: int, max_events: int) -> dict:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from gpuscope.server.config import ServerConfig
    from gpuscope.server.engine import Request
    from gpuscope.server.protocol import new_trace_id, parse_traceparent, traceparent
    from gpuscope.server.tracing import RequestTracing

    class HostClock:
        """The engine's step-timer interface at its cheapest (``--timing off``'s clock does this much)."""

        def start(self, op, on_elapsed=None):
            return time.perf_counter(), on_elapsed

        def stop(self, handle) -> None:
            began, callback = handle
            if callback is not None:
                callback(time.perf_counter() - began)

    class Keep(SpanExporter):
        def __init__(self) -> None:
            self.spans: list = []

        def export(self, spans):
            if len(self.spans) < 4096:
                self.spans.extend(spans)
            return SpanExportResult.SUCCESS

    config = ServerConfig(tracing_endpoint="http://127.0.0.1:9/v1/traces",
                          tracing_max_step_events=max_events).validate()
    sink = Keep()
    tracing = RequestTracing(config, None, exporter=sink, max_queue_size=1 << 20, max_export_batch_size=512,
                             schedule_delay_millis=100, gpu_wait_s=0.0, backlog=1 << 20)
    plain = HostClock()
    service = SimpleNamespace(engine=SimpleNamespace(on_step=None, timer=HostClock()), config=config,
                              scheduler=SimpleNamespace(waiting=lambda: 0),
                              device=SimpleNamespace(type="cpu"))
    tracing.attach(service)
    timer, on_step = service.engine.timer, service.engine.on_step
    builder_tid = tracing._builder.native_id
    headers = [{}, {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}]
    prompt = list(range(1, 33))
    loop_on = loop_off = engine_on = engine_off = 0.0
    builder_before = thread_cpu(builder_tid)
    done = 0
    while done < requests_n:
        group = []
        for i in range(batch):  # a batch of requests that arrive, decode and finish together
            h = headers[i % 2]
            t0 = time.thread_time()
            trace_id = parse_traceparent(h.get("traceparent")) or new_trace_id()
            traceparent(trace_id)
            t1 = time.thread_time()
            rt = tracing.begin(h)
            t2 = time.thread_time()
            req = Request("default", prompt, steps, 0.0, rt.trace_id)
            t3 = time.thread_time()
            tracing.track(rt, req, "default")
            t4 = time.thread_time()
            loop_off += t1 - t0
            loop_on += (t2 - t1) + (t4 - t3)
            group.append((rt, req))
        reqs = [req for _, req in group]
        now = time.perf_counter()
        for req in reqs:
            req.scheduled_at = now
        for step in range(steps):
            op = "prefill" if step == 0 else "decode"
            t0 = time.thread_time()
            plain.stop(plain.start(op, on_elapsed=lambda s: None))
            t1 = time.thread_time()
            timer.stop(timer.start(op, on_elapsed=lambda s: None))
            on_step(op, reqs, 0.001)
            t2 = time.thread_time()
            engine_off += t1 - t0
            engine_on += t2 - t1
            now = time.perf_counter()
            for req in reqs:
                if req.first_token_at is None:
                    req.first_token_at = now
                req.generated.append(7)
        now = time.perf_counter()
        for rt, req in group:
            req.finished_at, req.outcome = now, "length"
            t0 = time.thread_time()
            tracing.end(rt, 200)
            loop_on += time.thread_time() - t0
        done += batch
    deadline = time.monotonic() + 120
    while tracing._backlog and time.monotonic() < deadline:
        time.sleep(0.01)
    builder = thread_cpu(builder_tid) - builder_before
    tracing.flush(30)
    spans = sink.spans[: 4 * 256]
    per_request = len(spans) / max(1, len({s.context.trace_id for s in spans}))
    t0 = time.thread_time()
    for i in range(0, len(spans), 64):
        encode_spans(spans[i:i + 64]).SerializeToString()
    encode = (time.thread_time() - t0) / max(1, len(spans)) * per_request
    tracing.close(10)
    us = 1e6 / done
    return {
        "requests": done, "batch": batch, "steps": steps, "spans_per_request": per_request,
        "loop_us_per_request": {"on": loop_on * us, "off": loop_off * us, "extra": (loop_on - loop_off) * us},
        "engine_us_per_request": {"on": engine_on * 1e6 / done, "off": engine_off * 1e6 / done,
                                  "extra": (engine_on - engine_off) * 1e6 / done},
        "engine_us_per_step": {"extra": (engine_on - engine_off) * 1e6 / (done / batch * steps)},
        "builder_us_per_request": builder * us,
        "encode_us_per_request": encode * 1e6,
    }


# --- part 2: two servers, paired rounds --------------------------------------------------------------

class Server(ServerProcess):
    """``gpuscope serve`` logging warnings only, launched at once: both servers load together."""

    def __init__(self, name: str, flags: list[str], env: dict) -> None:
        super().__init__([*flags, "--log.level", "warning"], env=env, name=f"{name} server")
        self.launch()

    def wait_ready(self, timeout_s: float | None = None) -> Server:
        try:
            return super().wait_ready(timeout_s)
        except ServerError as exc:
            raise SystemExit(str(exc)) from None

    def cpu(self) -> float:
        return process_cpu(self.pid)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)


async def load(url: str, requests_n: int, concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    latencies: list[float] = []
    tokens = errors = 0
    issued = 0
    body = {"prompt": "Tracing costs what, exactly?", "max_tokens": max_tokens, "temperature": 1.0}

    async def client(session) -> None:
        nonlocal tokens, errors, issued
        while issued < requests_n:
            issued += 1
            began = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as r:
                answer = await r.json()
            latencies.append(time.perf_counter() - began)
            if r.status != 200:
                errors += 1
            else:
                tokens += answer["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        began = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    return {"wall_s": wall, "tokens": tokens, "errors": errors, "p50_ms": statistics.median(latencies) * 1e3}


def run_round(server: Server, args, receiver: OtlpSink | None) -> dict:
    before_spans = receiver.span_count if receiver is not None else 0
    cpu0 = server.cpu()
    result = asyncio.run(load(server.url, args.requests, args.concurrency, args.max_tokens))
    time.sleep(args.settle)  # the traced server builds and exports the round's spans; both idle as long
    result["cpu_s"] = server.cpu() - cpu0
    result["cpu_us_per_request"] = result["cpu_s"] / args.requests * 1e6
    result["tokens_per_s"] = result["tokens"] / result["wall_s"]
    if receiver is not None:
        result["spans_received"] = receiver.span_count - before_spans
    return result


def measure_served(args) -> dict:
    receiver = OtlpSink(keep=False)  # counts only: every kept request would stay in memory
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    flags = ["--model.device", args.device, "--model.layers", str(args.layers), "--model.dim", str(args.dim),
             "--model.heads", str(args.heads), "--model.context", "512", "--request.max-tokens",
             str(args.max_tokens), "--batch.max-size", str(args.batch_size), "--queue.max-per-tenant", "1024"]
    traced_env = dict(env)
    if args.export_delay_ms is not None:  # else the SDK's default export interval (5 s)
        traced_env["OTEL_BSP_SCHEDULE_DELAY"] = str(args.export_delay_ms)
    traced_flags = ["--tracing.endpoint", receiver.url,
                    "--tracing.max-step-events", str(args.max_step_events)]
    if args.sample_ratio is not None:
        traced_flags += ["--tracing.sample-ratio", str(args.sample_ratio)]
    servers = {"off": Server("off", flags, env),
               "on": Server("on", [*flags, *traced_flags], traced_env)}
    try:
        for server in servers.values():
            server.wait_ready(300)
        log("warm-up round on each server (not counted)")
        for name, server in servers.items():
            run_round(server, args, receiver if name == "on" else None)
        pairs = []
        for i in range(args.pairs):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            pair = {}
            for name in order:
                pair[name] = run_round(servers[name], args, receiver if name == "on" else None)
            pair["cpu_us_extra"] = pair["on"]["cpu_us_per_request"] - pair["off"]["cpu_us_per_request"]
            pair["tokens_per_s_ratio"] = pair["on"]["tokens_per_s"] / pair["off"]["tokens_per_s"]
            pair["order"] = list(order)
            pairs.append(pair)
            log(f"pair {i + 1}/{args.pairs}: CPU/request off {pair['off']['cpu_us_per_request']:.0f} µs, "
                f"on {pair['on']['cpu_us_per_request']:.0f} µs; tokens/s on/off "
                f"{pair['tokens_per_s_ratio']:.3f}; spans received {pair['on'].get('spans_received')}")
        dropped = servers["on"].metric("gpuscope_trace_spans_dropped_total")
        exported = servers["on"].metric("gpuscope_trace_spans_exported_total")
    finally:
        for server in servers.values():
            server.stop()
        receiver.stop()
    return {
        "pairs": pairs,
        "cpu_us_per_request": {"off": quartiles([p["off"]["cpu_us_per_request"] for p in pairs]),
                               "on": quartiles([p["on"]["cpu_us_per_request"] for p in pairs]),
                               "extra": quartiles([p["cpu_us_extra"] for p in pairs])},
        "tokens_per_s": {"off": quartiles([p["off"]["tokens_per_s"] for p in pairs]),
                         "on": quartiles([p["on"]["tokens_per_s"] for p in pairs]),
                         "ratio_on_off": quartiles([p["tokens_per_s_ratio"] for p in pairs])},
        "p50_ms": {"off": quartiles([p["off"]["p50_ms"] for p in pairs]),
                   "on": quartiles([p["on"]["p50_ms"] for p in pairs])},
        "spans_exported_total": exported, "spans_dropped_total": dropped,
        "spans_received_total": receiver.span_count,
        "errors": sum(p[n]["errors"] for p in pairs for n in ("on", "off")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON report path")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host")
    parser.add_argument("--parts", default="parts,served", help="comma list of parts,served")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--requests", type=int, default=None, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds after each round's load (default: the export interval + 1.5 s)")
    parser.add_argument("--export-delay-ms", type=int, default=None,
                        help="the traced server's OTEL_BSP_SCHEDULE_DELAY (default: the SDK's, 5000)")
    parser.add_argument("--sample-ratio", type=float, default=None, help="the traced server's ratio")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of the in-process part")
    parser.add_argument("--parts-requests", type=int, default=4000)
    parser.add_argument("--max-step-events", type=int, default=8, help="the server's default")
    args = parser.parse_args(argv)
    require_packages()
    import torch

    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise SystemExit("tracing_bench: --device cuda but torch sees no GPU")
    args.layers = args.layers or (6 if gpu else 2)
    args.dim = args.dim or (512 if gpu else 128)
    args.heads = args.heads or (8 if gpu else 4)
    args.requests = args.requests or (400 if gpu else 200)
    if args.quick:
        args.pairs, args.requests, args.repeats, args.parts_requests = 2, 24, 1, 256
        args.concurrency, args.export_delay_ms = 4, 200
    if args.settle is None:
        args.settle = (args.export_delay_ms if args.export_delay_ms is not None else 5000) / 1000 + 1.5
    report = {
        "benchmark": "tracing_bench", "date": utc_now(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0) if gpu else None,
                 "opentelemetry_sdk": importlib.metadata.version("opentelemetry-sdk")},
        "args": vars(args),
    }
    wanted = set(args.parts.split(","))
    if "parts" in wanted:
        log(f"in-process parts: {args.repeats} × {args.parts_requests} requests, batch {args.batch_size}, "
            f"{args.max_tokens} steps")
        runs = [measure_parts(args.parts_requests, args.batch_size, args.max_tokens, args.max_step_events)
                for _ in range(args.repeats)]
        keys = [("loop_us_per_request", "on"), ("loop_us_per_request", "off"),
                ("loop_us_per_request", "extra"), ("engine_us_per_request", "extra"),
                ("engine_us_per_step", "extra")]
        summary = {f"{a}.{b}": quartiles([r[a][b] for r in runs]) for a, b in keys}
        for key in ("builder_us_per_request", "encode_us_per_request"):
            summary[key] = quartiles([r[key] for r in runs])
        report["parts"] = {"runs": runs, "summary": summary}
        log("parts: loop +{:.1f} µs, engine +{:.1f} µs, builder {:.0f} µs, encode {:.0f} µs a request".format(
            summary["loop_us_per_request.extra"]["median"], summary["engine_us_per_request.extra"]["median"],
            summary["builder_us_per_request"]["median"], summary["encode_us_per_request"]["median"]))
    if "served" in wanted:
        log(f"served: {args.pairs} pairs × {args.requests} requests, concurrency {args.concurrency}, "
            f"model {args.layers}×{args.dim} on {args.device}")
        report["served"] = measure_served(args)
        s = report["served"]
        log(f"served: CPU per request +{s['cpu_us_per_request']['extra']['median']:.0f} µs (median of "
            f"pairs), tokens/s on/off {s['tokens_per_s']['ratio_on_off']['median']:.3f}")
    write_json(args.out, report)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
