#!/usr/bin/env python3
"""guidellm and aiperf against ``gpuscope serve`` with their default request flags.

Each tool is installed in its own virtual environment (both pull their own torch):

    python3 -m venv /opt/guidellm && /opt/guidellm/bin/pip install torch==2.13.0 guidellm
    python3 -m venv /opt/aiperf && /opt/aiperf/bin/pip install torch==2.13.0 aiperf

The server runs ``--model.hf`` on a tiny random Llama with a tokenizer made offline (``hf_serve_bench``'s
``--quick`` model), and each tool gets the server's URL and that tokenizer's folder, nothing about the
request format: both default to streaming (guidellm) or plain (aiperf) ``/v1/chat/completions``;
guidellm first checks ``GET /health``. guidellm 0.8 has no default data or profile, so it gets the
smallest of both (``synthetic_text`` 64 tokens in, 32 out; 4 concurrent streams) and a request
count; aiperf gets ``--request-count``. Per tool: exit code, wall time, what the tool counted (requests,
errors, mean TTFT when streaming) and what the server counted for the same run (requests by outcome,
client errors), so "exit 0 with every request failed" cannot pass.

    python benchmarks/client_tools_run.py --guidellm /opt/guidellm/bin/guidellm \\
        --aiperf /opt/aiperf/bin/aiperf --out benchmarks/results/client-tools-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import utc_now, write_json  # noqa: E402

from gpuscope.loadtest.serverproc import ServerProcess  # noqa: E402

OUTCOMES = ("stop", "length", "abort", "error", "rejected")


def server_counts(url: str) -> dict[str, float]:
    """Finished requests by outcome and client errors, all tenants added."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpuscope_requests_total":
                counts[s.labels["outcome"]] = counts.get(s.labels["outcome"], 0.0) + s.value
            elif s.name == "gpuscope_http_client_errors_total":
                key = "client_error_" + s.labels["reason"]
                counts[key] = counts.get(key, 0.0) + s.value
            elif s.name == "gpuscope_request_ttft_seconds_count":
                counts["ttft_samples"] = counts.get("ttft_samples", 0.0) + s.value
            elif s.name == "gpuscope_request_ttft_seconds_sum":
                counts["ttft_sum_s"] = counts.get("ttft_sum_s", 0.0) + s.value
    return counts


def counted(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the server counted between two scrapes; the mean TTFT it recorded (ms) over them."""
    out: dict[str, Any] = {k: int(after.get(k, 0.0) - before.get(k, 0.0))
                           for k in sorted(set(before) | set(after)) if k != "ttft_sum_s"}
    total = after.get("ttft_sum_s", 0.0) - before.get("ttft_sum_s", 0.0)
    out["ttft_mean_ms"] = round(total / out["ttft_samples"] * 1e3, 2) if out.get("ttft_samples") else None
    return out


def guidellm_command(binary: str, url: str, tokenizer: Path, requests: int) -> list[str]:
    return [binary, "run", "--backend", f"kind=openai_http,target={url}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={requests}", "--disable-console-interactive"]


def aiperf_command(binary: str, url: str, tokenizer: Path, model: str, requests: int) -> list[str]:
    return [binary, "profile", "--model", model, "--url", url, "--tokenizer", str(tokenizer),
            "--request-count", str(requests), "--ui-type", "none"]


def guidellm_summary(workdir: Path) -> dict[str, Any]:
    report = json.loads((workdir / "benchmarks.json").read_text())
    bench = report["benchmarks"][0]
    totals = bench["scheduler_metrics"]["requests_made"] if "scheduler_metrics" in bench else {}
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
    return {"requests": totals, "ttft_mean_ms": round(ttft["mean"], 2),
            "ttft_median_ms": round(ttft["median"], 2)}


def aiperf_summary(workdir: Path) -> dict[str, Any]:
    found = sorted(workdir.glob("artifacts/*/profile_export_aiperf.json"))
    report = json.loads(found[-1].read_text())
    return {"requests": report["request_count"]["avg"],
            "errors": report.get("error_summary") or [],
            "request_latency_mean_ms": round(report["request_latency"]["avg"], 1),
            "usage_completion_tokens_diff_pct": round(
                report.get("usage_completion_tokens_diff_pct", {}).get("avg", float("nan")), 1)}


#: Per tool, extra environment. guidellm is told to stay offline; aiperf is not: with
#: HF_HUB_OFFLINE set, aiperf 0.13 takes a tokenizer folder for a hub repository id and fails
#: ("Repo id must be in the form 'repo_name'..."). A folder on disk is loaded from disk either way.
TOOL_ENV = {"guidellm": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, "aiperf": {}}


def run_tool(name: str, command: list[str], server: ServerProcess, workdir: Path, summarize,
             timeout_s: float, expected: int) -> dict[str, Any]:
    """Run one tool; ok when it exits 0 and the server finished all ``expected`` requests, none failed
    (a request the server refuses with a 4xx never reaches its counts: a tool exiting 0 over 400s fails)."""
    workdir.mkdir(parents=True, exist_ok=True)
    before = server_counts(server.url)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **TOOL_ENV[name]})
        rc, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = None, f"timed out after {timeout_s}s: {str(exc.stdout or '')[-1000:]}"
    result: dict[str, Any] = {"command": [Path(command[0]).name, *command[1:]], "exit_code": rc,
                              "wall_s": round(time.perf_counter() - started, 1),
                              "server": counted(before, server_counts(server.url))}
    try:
        result["tool"] = summarize(workdir)
    except (OSError, KeyError, IndexError, ValueError) as exc:
        result["tool"] = {"error": f"{type(exc).__name__}: {exc}"}
        result["output_tail"] = tail
    served = result["server"].get("stop", 0) + result["server"].get("length", 0)
    failed = sum(result["server"].get(k, 0) for k in ("abort", "error", "rejected"))
    result["ok"] = rc == 0 and served == expected and failed == 0 and "error" not in result["tool"]
    if not result["ok"]:
        result.setdefault("output_tail", tail)
    print(f"{name}: exit {rc}, server finished {served} (failed {failed}), ok={result['ok']}",
          file=sys.stderr)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hf_serve_bench import build_model

    report: dict[str, Any] = {"date": utc_now(), "tools": {}}
    with tempfile.TemporaryDirectory(prefix="client-tools-") as tmp:
        folder = Path(tmp) / "tiny"
        folder.mkdir()
        report["model"] = build_model(folder, quick=True)
        env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        server = ServerProcess(["--model.hf", str(folder), "--model.context", "1024",
                                "--request.max-tokens", str(args.max_tokens), "--log.level", "warning"],
                               log_path=Path(tmp) / "serve.log", env=env, ready_timeout_s=300)
        with server:
            if args.guidellm:
                command = guidellm_command(args.guidellm, server.url, folder, args.requests)
                report["tools"]["guidellm"] = run_tool("guidellm", command, server, Path(tmp) / "guidellm",
                                                       guidellm_summary, args.timeout, args.requests)
            if args.aiperf:
                command = aiperf_command(args.aiperf, server.url, folder, folder.name, args.requests)
                report["tools"]["aiperf"] = run_tool("aiperf", command, server, Path(tmp) / "aiperf",
                                                     aiperf_summary, args.timeout, args.requests)
    for tool in ("guidellm", "aiperf"):
        binary = getattr(args, tool)
        if binary:
            version = subprocess.run([str(Path(binary).parent / "pip"), "show", tool], capture_output=True,
                                     text=True).stdout
            report["tools"][tool]["version"] = next((line.split()[-1] for line in version.splitlines()
                                                     if line.startswith("Version:")), None)
    report["ok"] = bool(report["tools"]) and all(t["ok"] for t in report["tools"].values())
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", help="the guidellm executable (of its own virtual environment)")
    p.add_argument("--aiperf", help="the aiperf executable (of its own virtual environment)")
    p.add_argument("--requests", type=int, default=24, help="requests per tool")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="the server's --request.max-tokens: aiperf's requests set no max_tokens")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds per tool")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not (args.guidellm or args.aiperf):
        p.error("give --guidellm, --aiperf or both")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    write_json(args.out, report)
    print(json.dumps({k: {"ok": v["ok"], "exit": v["exit_code"], "server": v["server"]}
                      for k, v in report["tools"].items()}, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
