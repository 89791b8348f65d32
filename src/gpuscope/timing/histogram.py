"""A histogram written by one thread (the resolver) and read at scrape time.

prometheus_client's ``Histogram.observe`` takes a lock and walks every bucket;
the resolver observes thousands of samples a second while holding the GIL the
inference thread wants, so it bumps one non-cumulative bucket instead and the
cumulative sums are built only at scrape (what client_python itself does).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence


class BucketHistogram:
    """Counts per bucket (upper bounds inclusive, plus +Inf), sum, and the last exemplar per bucket."""

    __slots__ = ("bounds", "count", "counts", "exemplars", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0
        self.exemplars: list[tuple[str, float, float] | None] = [None] * (len(self.bounds) + 1)

    def observe(self, value: float, trace_id: str | None = None) -> None:
        index = bisect_left(self.bounds, value)
        self.counts[index] += 1
        self.sum += value
        self.count += 1
        if trace_id:
            self.exemplars[index] = (trace_id, value, time.time())

    def cumulative(self) -> list[tuple[str, int, tuple[str, float, float] | None]]:
        """``[(le, cumulative count, exemplar), ...]`` ending with ``+Inf``, as exposition wants."""
        out = []
        running = 0
        counts = list(self.counts)  # a consistent copy: the resolver may observe meanwhile
        for index, bound in enumerate((*self.bounds, float("inf"))):
            running += counts[index]
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append((le, running, self.exemplars[index]))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (for tests and benchmarks)."""
        target = q * self.count
        running = 0
        for index, n in enumerate(self.counts):
            running += n
            if running >= target and n:
                return self.bounds[index] if index < len(self.bounds) else float("inf")
        return float("nan")
