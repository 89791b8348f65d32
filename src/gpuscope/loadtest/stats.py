"""Throughput and latency percentiles from exact request records.

Percentiles interpolate linearly between order statistics (numpy's default), so
p50 of [1, 2] is 1.5 and figures match what a reader gets from numpy or pandas.
Rates divide by the measurement window, not by the span of the samples, so a
run that served nothing for half its time reports half the throughput; requests
count when they finish and tokens when they arrive (see :func:`summarise`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100) of values; None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """One run (or one tenant of one run) in the units reports use."""

    requests: int
    errors: int
    window_s: float
    rps: float
    tps: float
    error_rate: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def chunk_arrivals(request: dict[str, Any]) -> list[float]:
    """Unix times at which a request's token chunks arrived: send + TTFT, then each gap."""
    if request.get("ttft") is None:
        return []
    times = [request["t"] + request["ttft"]]
    for gap in request.get("itl", ()):
        times.append(times[-1] + gap)
    return times


def summarise(requests: Iterable[dict[str, Any]], window_start: float, window_end: float,
              tenant: str | None = None) -> Summary:
    """Summary of the window [window_start, window_end) (unix seconds).

    Requests count when they finish and tokens when they arrive, so long requests
    that straddle the window's edges are neither lost nor counted twice: one sent
    during warm-up that ends inside counts, and one cut off by the end of the run
    (``cut``) adds the tokens it received but no request. TTFT counts where the
    first token arrived, each inter-token gap where its token arrived, end-to-end
    where the request finished. ``tenant`` restricts to one tenant's requests.
    """
    window = window_end - window_start
    if window <= 0:
        raise ValueError(f"empty measurement window ({window:.3f} s)")
    ok = errors = 0
    tokens = 0.0
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []

    def inside(t: float) -> bool:
        return window_start <= t < window_end

    for r in requests:
        if tenant is not None and r["tenant"] != tenant:
            continue
        cut = bool(r.get("cut"))
        finished = None if cut or r["e2e"] is None else r["t"] + r["e2e"]
        if not r["ok"] and not cut:
            errors += finished is not None and inside(finished)
            continue
        if finished is not None and inside(finished):
            ok += 1
            e2e.append(r["e2e"])
        arrivals = chunk_arrivals(r)
        per_chunk = r["tokens"] / len(arrivals) if arrivals else 0.0  # servers may merge tokens
        for i, at in enumerate(arrivals):
            if inside(at):
                tokens += per_chunk
                if i == 0:
                    ttft.append(r["ttft"])
                else:
                    itl.append(r["itl"][i - 1])
    total = ok + errors
    return Summary(
        requests=total, errors=errors, window_s=window,
        rps=ok / window, tps=tokens / window,
        error_rate=errors / total if total else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
        e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99),
    )


def tenants_of(requests: Iterable[dict[str, Any]]) -> list[str]:
    return sorted({r["tenant"] for r in requests})
