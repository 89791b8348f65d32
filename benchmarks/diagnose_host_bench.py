#!/usr/bin/env python3
"""`gpuscope diagnose` with no server, on four GPU processes as a training job or notebook runs them.

Each case starts one workload process, waits until it is warm, runs
`gpuscope diagnose --server '' --duration D --json-file ...` beside it and keeps the transcript,
the exit status and the findings:

- ``launch_bound``: ResNet-18 inference, batch 1, eager, back to back: one Python thread issues every
  kernel and the GPU waits for it (expected ``launch_bound``, exit 1);
- ``gpu_bound``: ResNet-50 training, batch 64, bf16 autocast (expected: no problem, exit 0);
- ``data_loader_bound``: a small model fed by a `DataLoader` whose workers do per-sample Python work,
  so the workers are saturated and the GPU starves (expected ``data_loader_bound``, exit 1);
- ``idle_holder``: a process that allocated 20 GiB and sleeps (expected ``idle_gpu_holder``, a
  warning: exit 0, as warnings do).

    PYTHONPATH=src python benchmarks/diagnose_host_bench.py --out benchmarks/results/diagnose-host-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from benchlib import logger, utc_now, write_json  # noqa: E402

log = logger("diagnose-host")
#: case -> (the finding expected, or None; the exit status expected: 1 for a problem, 0 otherwise)
CASES = {"launch_bound": ("launch_bound", 1), "gpu_bound": (None, 0),
         "data_loader_bound": ("data_loader_bound", 1), "idle_holder": ("idle_gpu_holder", 0)}


# --- the workloads (each runs as its own process until killed) ---------------------------------------

def _ready() -> None:
    print("ready", flush=True)


def launch_bound() -> None:
    import torch
    import torchvision

    model = torchvision.models.resnet18().cuda().eval()
    x = torch.randn(1, 3, 224, 224, device="cuda")
    with torch.no_grad():
        for _ in range(20):
            model(x)
        torch.cuda.synchronize()
        _ready()
        while True:
            model(x)
            torch.cuda.synchronize()


def gpu_bound() -> None:
    import torch
    import torchvision

    model = torchvision.models.resnet50().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (64,), device="cuda")
    for i in range(10**9):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % 10 == 0:
            loss.item()
        if i == 5:
            _ready()


class _SlowSamples:
    """A dataset whose samples cost Python work on the CPU (decoding and augmenting, in effect)."""

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, i: int):
        import torch

        acc = 0
        for k in range(60_000):
            acc = (acc * 31 + k + i) % 1_000_003
        return torch.full((3, 64, 64), float(acc % 7))


def data_loader_bound() -> None:
    import torch
    import torchvision

    model = torchvision.models.resnet18().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_SlowSamples(), batch_size=32, num_workers=4)
    for i, batch in enumerate(loader):
        loss = model(batch.cuda(non_blocking=True)).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        if i == 3:
            _ready()


def idle_holder() -> None:
    import torch

    held = torch.empty(20 << 30, dtype=torch.uint8, device="cuda")
    held.fill_(1)
    torch.cuda.synchronize()
    _ready()
    while True:
        time.sleep(1)


WORKLOADS = {"launch_bound": launch_bound, "gpu_bound": gpu_bound, "data_loader_bound": data_loader_bound,
             "idle_holder": idle_holder}


# --- orchestration -------------------------------------------------------------------------------------

def run_case(name: str, duration_s: float, workdir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with tempfile.TemporaryFile(mode="w+") as err:
        workload = subprocess.Popen([sys.executable, os.path.abspath(__file__), "workload", name], env=env,
                                    stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            if workload.stdout.readline().strip() != "ready":
                err.seek(0)
                raise RuntimeError(f"{name} did not start: {err.read()[-1500:]}")
            time.sleep(2.0)  # its steady state, not its first steps
            json_path = workdir / f"{name}.json"
            cmd = [sys.executable, "-m", "gpuscope", "diagnose", "--server", "", "--duration",
                   f"{duration_s:g}s", "--json-file", str(json_path)]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 120, env=env)
            took = time.time() - t0
        finally:
            workload.kill()
            workload.wait(30)
    document = json.loads(json_path.read_text()) if json_path.exists() else {}
    findings = [f["code"] for s in document.get("summaries", []) for f in s["findings"]]
    expected, expected_status = CASES[name]
    diagnosed = proc.returncode == expected_status and (expected is None or expected in findings)
    return {"command": "gpuscope diagnose --server '' --duration " + f"{duration_s:g}s",
            "workload_pid": workload.pid, "exit_status": proc.returncode, "seconds": round(took, 1),
            "transcript": proc.stdout + proc.stderr, "findings": findings, "expected": expected,
            "diagnosed": diagnosed, "report": document}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "workload":
        WORKLOADS[argv[1]]()
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON report; each transcript also as OUT-STEM-CASE.txt")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--duration-s", type=float, default=8.0)
    args = p.parse_args(argv)
    out: dict[str, Any] = {"date": utc_now(), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            case = out["cases"][name] = run_case(name, args.duration_s, Path(tmp))
            log(f"{name}: exit {case['exit_status']}, findings {case['findings']}, expected "
                f"{case['expected'] or 'none'}: {'OK' if case['diagnosed'] else 'MISSED'}")
            stem = os.path.splitext(args.out)[0]
            Path(f"{stem}-{name}.txt").write_text(case["transcript"])
            write_json(args.out, out, indent=1)
    return 0 if all(c["diagnosed"] for c in out["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
