#!/usr/bin/env python3
"""Why is a decode step with one row slower than one with 32? Time the server's model step by step.

``gpuscope serve`` on the H200 took many times longer per decode step with a few rows than with 32
(docs/server.md, "How it works", *Attention*, gives the figures). This times the same model, cache
and sampling as the engine's ``_step`` (tensors built from lists, forward, ``sample``,
``.tolist()``), with

- rows 1, 2 and 32;
- attention spans that grow by one each step (as in serving: every step a shape never seen), the
  same spans a second time (shapes seen before), and spans rounded up to ``--bucket``;
- each SDPA backend PyTorch offers here, forced one at a time, PyTorch's default choice and
  gpuscope's (what ``build_model`` leaves: cuDNN attention switched off, see
  ``model.avoid_per_shape_attention_plans``);

then profiles PyTorch's default choice with new spans with ``torch.profiler`` and prints its top operators.

    python benchmarks/step_profile.py --out benchmarks/results/step-profile-h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
from benchlib import today, write_json
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpuscope.server.config import ModelSpec
from gpuscope.server.model import build_model, sample

BACKEND_NAMES = ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION")


def backends() -> dict[str, Callable[[], AbstractContextManager]]:
    """Case name → a context choosing the SDPA backends (this script is single-threaded, so
    PyTorch's process-wide switches are safe to flip per case)."""
    every = [getattr(SDPBackend, name) for name in BACKEND_NAMES if hasattr(SDPBackend, name)]
    found: dict[str, Callable[[], AbstractContextManager]] = {
        "pytorch_default": lambda: sdpa_kernel(every),  # cuDNN back in, PyTorch's own priority
        "gpuscope": nullcontext,  # as build_model left it
    }
    for name in BACKEND_NAMES:
        member = getattr(SDPBackend, name, None)
        if member is not None:
            found[name.lower()] = lambda member=member: sdpa_kernel([member])
    return found


def decode_steps(model, rows: int, spans: list[int], device: torch.device) -> list[float]:
    """Seconds per decode step (host wall, after the ``.tolist()`` sync), one per span."""
    times = []
    slot_ids = list(range(rows))
    for span in spans:
        began = time.perf_counter()
        tokens = torch.tensor([[65] for _ in slot_ids], dtype=torch.long, device=device)
        slots = torch.tensor(slot_ids, dtype=torch.long, device=device)
        start = torch.tensor([span - 1] * rows, dtype=torch.long, device=device)
        last = torch.tensor([0] * rows, dtype=torch.long, device=device)
        temps = torch.tensor([0.0] * rows, dtype=torch.float32, device=device)
        sample(model(tokens, slots, start, last, span), temps).tolist()
        times.append(time.perf_counter() - began)
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_ms": statistics.median(ordered) * 1e3, "mean_ms": statistics.fmean(ordered) * 1e3,
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3, "max_ms": ordered[-1] * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48, help="decode steps per case")
    parser.add_argument("--first-span", type=int, default=80)
    parser.add_argument("--bucket", type=int, default=64)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    spec = ModelSpec(layers=args.layers, dim=args.dim, heads=args.heads, context=args.context)
    model = build_model(spec)
    device = next(model.parameters()).device
    model.allocate_cache(32)
    growing = list(range(args.first_span, args.first_span + args.steps))
    bucketed = [min(args.context, -(-s // args.bucket) * args.bucket) for s in growing]
    results: list[dict] = []
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {gpu}; torch {torch.__version__}", flush=True)
    with torch.inference_mode():
        decode_steps(model, 1, [8], device)  # first CUDA launch, cuBLAS handles
        for index, (backend, chosen) in enumerate(backends().items()):
            # Plan caches key on the row count too, so a span range per backend keeps "new" unseen.
            spans = [min(args.context, s + index * args.steps) for s in growing]
            for rows in (1, 2, 32):
                try:
                    with chosen():
                        new = decode_steps(model, rows, spans, device)
                        seen = decode_steps(model, rows, spans, device)
                        bucket = decode_steps(model, rows, bucketed, device)
                except RuntimeError as exc:  # a backend that cannot run this shape or mask
                    results.append({"backend": backend, "rows": rows, "error": str(exc).splitlines()[0]})
                    print(f"{backend:>20} rows {rows:>2}: {str(exc).splitlines()[0][:90]}", flush=True)
                    continue
                row = {"backend": backend, "rows": rows, "new_spans": summary(new),
                       "seen_spans": summary(seen), "bucketed_spans": summary(bucket)}
                results.append(row)
                print(f"{backend:>20} rows {rows:>2}: new {row['new_spans']['median_ms']:7.2f} ms  "
                      f"seen {row['seen_spans']['median_ms']:7.2f} ms  "
                      f"bucketed {row['bucketed_spans']['median_ms']:7.2f} ms", flush=True)

        profile_text = ""
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            spans = [min(args.context, s + len(backends()) * args.steps) for s in growing[:12]]
            # PyTorch's choice: the slow case this was written for.
            with backends()["pytorch_default"](), \
                    profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                decode_steps(model, 1, spans, device)
            profile_text = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18)
            print(profile_text)

    report = {"benchmark": "step_profile", "date": today(),
              "gpu": gpu,
              "torch": torch.__version__, "model": vars(args), "steps_per_case": args.steps,
              "cases": results, "profile_top_ops_rows1_new_spans": profile_text}
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
