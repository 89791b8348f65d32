"""The timer's data model: an op's sampling state and its histograms, one per device.

Two implementations of one interface, as for the hot path (``hot.py``): the C types
``_hotpath.OpState`` and ``_hotpath.BucketHistogram``, which every C loop updates through their
structs, and the Python classes below, which are the readable statement of what the C types do
and serve the Python hot path (where the extension is not built, or ``GPUSCOPE_TIMING_NATIVE=0``;
``hot.op_state_class`` picks one per timer). Every writer goes through ``OpState.observe`` (in C,
``opstate_observe``): the resolver's Python loop, the C hot path's loops and timed graph replays
(``graphs.py``). tests/timing/test_histogram.py runs the same inputs through both implementations
and checks that they agree.

A histogram keeps one non-cumulative count per bucket: prometheus_client's ``Histogram.observe``
takes a lock and walks every bucket, while the resolver observes thousands of samples a second
holding the GIL the inference thread wants; the cumulative sums are built only at scrape (what
client_python itself does).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

Exemplar = tuple[Any, float, float]  # (trace id, value, unix time)


def _les(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` label of each bucket, ``+Inf`` last."""
    return (*(repr(bound) for bound in bounds), "+Inf")


class BucketHistogram:
    """Counts per bucket (upper bounds inclusive, plus +Inf), sum, and the last exemplar per bucket.

    A value is a duration: a negative one (a baseline larger than the measurement) counts as 0, and
    NaN is refused (``observe`` returns False; nothing changes)."""

    __slots__ = ("_counts", "_exemplars", "_les", "bounds", "count", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(bound) for bound in bounds)
        if any(math.isnan(b) for b in self.bounds) or any(not a < b for a, b in pairwise(self.bounds)):
            raise ValueError("histogram bounds must be ascending numbers")
        self._les = _les(self.bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._exemplars: list[Exemplar | None] = [None] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    @property
    def counts(self) -> list[int]:
        """Per-bucket (not cumulative) counts, ``+Inf`` last: a copy."""
        return list(self._counts)

    @property
    def exemplars(self) -> list[Exemplar | None]:
        """The last exemplar of each bucket, ``+Inf`` last: a copy."""
        return list(self._exemplars)

    def observe(self, value: float, trace_id: Any = None) -> bool:
        """Count ``value`` (a trace id, when truthy, becomes its bucket's exemplar); False if refused."""
        if not value >= 0.0:  # negative or NaN: one comparison for the usual case
            if value != value:
                return False
            value = 0.0
        index = bisect_left(self.bounds, value)
        self._counts[index] += 1
        self.sum += value
        self.count += 1
        if trace_id:
            self._exemplars[index] = (trace_id, value, time.time())
        return True

    def cumulative(self) -> list[tuple[str, int, Exemplar | None]]:
        """``[(le, cumulative count, exemplar), ...]`` ending with ``+Inf``, as exposition wants."""
        out = []
        running = 0
        counts, exemplars = list(self._counts), list(self._exemplars)  # the resolver may observe meanwhile
        for le, n, exemplar in zip(self._les, counts, exemplars, strict=True):
            running += n
            out.append((le, running, exemplar))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (for tests and benchmarks); NaN when empty."""
        target = q * self.count
        running = 0
        for index, n in enumerate(self._counts):
            running += n
            if running >= target and n:
                return self.bounds[index] if index < len(self.bounds) else math.inf
        return math.nan


class OpState:
    """Per-op sampling state and histograms (one per device), owned by one timer.

    The sampling fields are plain attributes that the hot path's Python code reads and writes
    (``TimerCore.begin``, sequences, instrument()); the C type keeps them as Python objects too, so
    that access is as cheap there as a ``__slots__`` attribute here."""

    __slots__ = ("always", "bounds", "countdown", "entered", "fixed", "hists", "name", "owner", "period")

    def __init__(self, name: str, period: int, fixed: bool, bounds: Sequence[float]) -> None:
        self.name = name
        self.owner: Any = None  # the Instrumentation whose sampled passes count this op, if any
        self.period = period
        self.countdown = 0  # the first region of every op is timed
        self.entered = 0
        self.always = 0  # regions started with on_elapsed: timed every time, outside the budget's reach
        self.fixed = fixed
        self.bounds = tuple(bounds)  # of every histogram of the op
        self.hists: dict[Any, BucketHistogram] = {}

    def histogram(self, device: Any) -> BucketHistogram:
        """The histogram of ``device`` (made on first use)."""
        hist = self.hists.get(device)
        if hist is None:
            hist = self.hists[device] = BucketHistogram(self.bounds)
        return hist

    def observe(self, device: Any, seconds: float, trace_id: Any = None) -> bool:
        """One region's GPU seconds on ``device`` into its histogram; False if refused (NaN)."""
        hist = self.hists.get(device)  # inline: this runs for every sample on the Python resolver path
        if hist is None:
            hist = self.histogram(device)
        return hist.observe(seconds, trace_id)
