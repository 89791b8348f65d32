"""What an evaluator's abuse run does to ``gpuscope serve``, measured: stalled sockets, a short body,
SIGTERM with a stream running, and 8 kB invalid ``tracestate`` headers.

    python benchmarks/abuse_bench.py --out results/abuse-cpu.json
    python benchmarks/abuse_bench.py --out before.json --server-path OTHER/src        # another tree

Each part starts its own server (a small model on CPU) as a child process, with ``--server-path`` on
its ``PYTHONPATH`` (default: this checkout's), so the same run measures any version of the server:

- ``stalled``: N sockets each send half a request line and stall; the server's open descriptors once
  they settle, the connections it closed (``gpuscope_http_connections_closed_total``, where it has
  it), and whether a real request still gets through;
- ``short_body``: a body shorter than its ``Content-Length``: how long until the server answers or
  closes (capped), and with what;
- ``sigterm``: a long stream is running (the latency fault slows the model) when SIGTERM comes:
  what a new request gets, how the stream ends (finish, error chunk, ``[DONE]``), how long the
  server takes to exit;
- ``tracestate``: requests with an 8 kB invalid ``tracestate`` (tracing on): bytes the server's
  stderr grew by per request, and its lines without a timestamp.

``--quick`` (the CI smoke run) uses fewer sockets, requests and tokens. Progress on stderr, the
report as JSON at ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

from benchlib import logger, rnd, write_json  # noqa: E402

from gpuscope.ops import procs  # noqa: E402
from gpuscope.server.otlp_sink import OtlpSink  # noqa: E402
from gpuscope.util.freeport import free_port  # noqa: E402

log = logger("abuse_bench")
SMALL = ["--model.layers", "1", "--model.dim", "64", "--model.context", "1024", "--request.max-tokens", "900"]
TOKEN = "abuse-bench-token-0123456789"
STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


class Server:
    """``gpuscope serve`` from ``server_path`` on a free port, logging to a file."""

    def __init__(self, work: Path, name: str, server_path: Path, *args: str,
                 settings: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"{name}.log"
        # Settings as environment variables: a server version without them ignores them.
        env = {**os.environ, "PYTHONPATH": str(server_path), "PYTHONUNBUFFERED": "1", **(settings or {})}
        token = work / "token"
        token.write_text(TOKEN)
        argv = [sys.executable, "-m", "gpuscope", "serve", *SMALL, "--web.listen-address",
                f"127.0.0.1:{self.port}", "--faults.enable", "--faults.token-file", str(token), *args]
        self.child = procs.Child(argv, env=env, log_path=self.log_path, ready=self.url + "/readyz",
                                 grace_s=60, name=name).start()
        self.child.wait_ready(180)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.child.pid}/fd"))

    def metric(self, name: str, **labels: str) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.url + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def slow_down(self) -> None:
        requests.post(self.url + "/admin/faults/latency_spike", json={"extra_passes": 256, "duration_s": 600},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).raise_for_status()

    def stop(self) -> None:
        self.child.stop()


def _settled(read, interval: float = 0.25, still_s: float = 1.5, limit_s: float = 30.0) -> int:
    """``read()`` once it has not changed for ``still_s`` (or after ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < still_s:
        time.sleep(interval)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def stalled(work: Path, server_path: Path, sockets: int, settings: dict[str, str]) -> dict[str, Any]:
    server = Server(work, "stalled", server_path, settings=settings)
    held: list[socket.socket] = []
    try:
        baseline = server.fds()
        for _ in range(sockets):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"GET /v1/mod")
            held.append(sock)
        fds = _settled(server.fds)
        t0 = time.perf_counter()
        try:
            status = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                                   timeout=60).status_code
        except requests.RequestException as exc:
            status = f"no answer: {type(exc).__name__}"
        latency = time.perf_counter() - t0
        closed = {reason: server.metric("gpuscope_http_connections_closed_total", reason=reason)
                  for reason in ("evicted", "refused", "header_timeout")}
        log(f"stalled: {sockets} sockets → server holds {fds - baseline} more descriptors; request {status}")
        return {"sockets": sockets, "server_fds_before": baseline, "server_fds_held": fds,
                "extra_fds": fds - baseline, "request_status": status, "request_s": rnd(latency),
                "closed": closed}
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()
        server.stop()


def short_body(work: Path, server_path: Path, cap_s: float, settings: dict[str, str]) -> dict[str, Any]:
    server = Server(work, "short_body", server_path, settings=settings)
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 200\r\n\r\n")
        with socket.create_connection(("127.0.0.1", server.port), timeout=cap_s) as sock:
            t0 = time.perf_counter()
            sock.sendall(head + b'{"prompt": "hel')
            data = b""
            try:
                while chunk := sock.recv(65536):
                    data += chunk
                outcome = "closed"
            except TimeoutError:
                outcome = f"still open after {cap_s:g}s"
            waited = time.perf_counter() - t0
        status = int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None
        log(f"short body: {outcome} after {waited:.1f}s, status {status}")
        return {"outcome": outcome, "waited_s": rnd(waited), "status": status, "cap_s": cap_s}
    finally:
        server.stop()


def sigterm(work: Path, server_path: Path, tokens: int) -> dict[str, Any]:
    server = Server(work, "sigterm", server_path)
    events: list[str] = []
    first = threading.Event()

    def read() -> None:
        body = {"prompt": "hi", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        try:
            with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode())
                        first.set()
        except requests.RequestException as exc:
            events.append(f"<{type(exc).__name__}>")
        finally:
            first.set()

    try:
        server.slow_down()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        first.wait(60)
        t0 = time.perf_counter()
        server.child.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = requests.post(server.url + "/v1/completions", json={"prompt": "late"}, timeout=30)
            late_status: Any = late.status_code
            retry_after = late.headers.get("Retry-After")
        except requests.RequestException as exc:
            late_status, retry_after = f"no answer: {type(exc).__name__}", None
        code = server.child.wait(120)
        exit_s = time.perf_counter() - t0
        reader.join(60)
        tail = events[-2:]
        ended = ("[DONE]" if tail[-1:] == ["[DONE]"] else "no [DONE]")
        error_chunk = any('"error"' in e for e in tail)
        finished = any('"finish_reason": "length"' in e for e in tail)
        log(f"sigterm: late request {late_status}; stream {ended}, error chunk {error_chunk}, "
            f"finished {finished}; exit {code} after {exit_s:.1f}s")
        return {"stream_tokens_asked": tokens, "late_request_status": late_status, "retry_after": retry_after,
                "stream_chunks": len(events), "stream_ended_with_done": tail[-1:] == ["[DONE]"],
                "stream_error_chunk": error_chunk, "stream_finished": finished, "exit_status": code,
                "exit_s_after_sigterm": rnd(exit_s)}
    finally:
        server.stop()


def tracestate(work: Path, server_path: Path, count: int) -> dict[str, Any]:
    sink = OtlpSink(keep=False)
    server = Server(work, "tracestate", server_path, "--tracing.endpoint", sink.url)
    try:
        junk = "X=v 2026-01-01 00:00:00,000 ERROR gpuscope.server forged " + "j" * 8000
        before = server.log_path.stat().st_size
        for _ in range(count):
            headers = {"traceparent": f"00-{os.urandom(16).hex()}-{'1' * 16}-01", "tracestate": junk}
            requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          headers=headers, timeout=60).raise_for_status()
        grown = _settled(lambda: server.log_path.stat().st_size) - before
        lines = server.log_path.read_text(errors="replace").splitlines()
        unstamped = [line for line in lines if line and not STAMPED.match(line)]
        ignored = server.metric("gpuscope_trace_context_ignored_total", header="tracestate")
        log(f"tracestate: stderr grew {grown / count:.0f} bytes a request; {len(unstamped)} lines without a "
            "timestamp")
        return {"requests": count, "tracestate_bytes": len(junk),
                "stderr_bytes_per_request": rnd(grown / count, 1), "lines_without_timestamp": len(unstamped),
                "raw_junk_in_stderr": "j" * 100 in "\n".join(lines), "ignored_counted": ignored}
    finally:
        server.stop()
        sink.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="abuse_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON report to write")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: fewer sockets, requests, tokens")
    parser.add_argument("--server-path", type=Path, default=ROOT / "src",
                        help="the gpuscope package folder the servers run from (default: this checkout's)")
    parser.add_argument("--sockets", type=int, default=None, help="stalled sockets (default 2000; quick 40)")
    args = parser.parse_args(argv)
    sockets = args.sockets or (40 if args.quick else 2000)
    # Quick: a cap below the sockets and a short body deadline, so both act within the smoke run.
    quick = {"GPUSCOPE_WEB_MAX_CONNECTIONS": "16", "GPUSCOPE_WEB_BODY_TIMEOUT": "3s"} if args.quick else {}
    parts: dict[str, Any] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="abuse-bench-") as tmp:
        work = Path(tmp)
        runs = {"stalled": lambda: stalled(work, args.server_path, sockets, quick),
                "short_body": lambda: short_body(work, args.server_path, 15.0 if args.quick else 60.0, quick),
                "sigterm": lambda: sigterm(work, args.server_path, 400 if args.quick else 900),
                "tracestate": lambda: tracestate(work, args.server_path, 3 if args.quick else 20)}
        for name, run in runs.items():
            try:
                parts[name] = run()
            except Exception as exc:
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
                log(f"{name} failed: {exc}")
    report = {"server_path": str(args.server_path), "quick": args.quick, "settings": quick, "parts": parts,
              "failures": failures,
              "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"}
    write_json(args.out, report)
    print(f"written {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
