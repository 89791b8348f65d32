"""A tenant for trying `gpuscope share`: ``python -m gpuscope.share.demo [--size N] [--heartbeat PATH]``.

On a CUDA GPU it multiplies two bf16 matrices in a loop and prints its steps per second every 5 s: run
two of them as different tenants (compose's ``share`` profile does) and their rates follow the shares.
Without CUDA it says so and runs a CPU loop instead, which no share holds, so the rest of the wiring
(joins, metrics, dashboards) can still be looked at. ``--heartbeat`` touches a file at each report (a
container healthcheck reads its age).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPORT_EVERY_S = 5.0


def _report(label: str, steps: int, elapsed: float, heartbeat: str | None) -> None:
    tenant = os.environ.get("GPUSCOPE_SHARE_TENANT", "-")
    print(f"tenant={tenant} {label} {steps / elapsed:.1f} steps/s", flush=True)
    if heartbeat:
        with open(heartbeat, "a"):
            os.utime(heartbeat)


def run_cuda(torch, size: int, heartbeat: str | None, duration_s: float | None) -> None:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    name = torch.cuda.get_device_name()
    print(f"gpuscope share demo: {size}x{size} bf16 matmul on {name}", flush=True)
    start = last = time.monotonic()
    steps = 0
    while duration_s is None or time.monotonic() - start < duration_s:
        torch.matmul(a, b, out=c)
        steps += 1
        if steps % 8 == 0:
            torch.cuda.synchronize()  # steps count finished work, and the queue stays short
            now = time.monotonic()
            if now - last >= REPORT_EVERY_S:
                _report("gpu", steps, now - last, heartbeat)
                steps, last = 0, now


def run_cpu(size: int, heartbeat: str | None, duration_s: float | None) -> None:
    print("gpuscope share demo: no CUDA GPU here (torch without CUDA, or no device visible), so no share "
          "holds this process; running a CPU loop instead", flush=True)
    n = max(16, size // 64)
    a = [[float((i * n + j) % 7) for j in range(n)] for i in range(n)]
    start = last = time.monotonic()
    steps = 0
    while duration_s is None or time.monotonic() - start < duration_s:
        cols = list(zip(*a, strict=True))
        _ = [[sum(x * y for x, y in zip(row, col, strict=True)) for col in cols] for row in a]
        steps += 1
        now = time.monotonic()
        if now - last >= REPORT_EVERY_S:
            _report("cpu", steps, now - last, heartbeat)
            steps, last = 0, now


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuscope.share.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="matrix size (default 4096)")
    parser.add_argument("--heartbeat", default=None, help="file touched at each report")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds to run (default: until stopped)")
    args = parser.parse_args(argv)
    if args.size <= 0:
        parser.error("--size must be positive")
    try:
        import torch
    except ImportError:
        torch = None
    try:
        if torch is not None and torch.cuda.is_available():
            run_cuda(torch, args.size, args.heartbeat, args.duration)
        else:
            run_cpu(args.size, args.heartbeat, args.duration)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
