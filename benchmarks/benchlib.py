"""What the benchmark scripts share: progress lines, a result's date, writing the result JSON,
JSON-safe rounding, a percentile and quartiles.

benchmarks/ is not a package: a script imports this as ``benchlib`` with its own folder on
``sys.path`` (where Python puts it when the script is run; a script that may be run otherwise, such
as through ``runpy``, puts it there itself).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def logger(tag: str | None, stream: TextIO | None = None) -> Callable[[str], None]:
    """``log(message)``: ``[TAG HH:MM:SS] message`` (``[HH:MM:SS] message`` without a tag), flushed,
    on ``stream``: stderr unless given (stdout is for the report)."""
    prefix = f"{tag} " if tag else ""

    def log(message: str) -> None:
        print(f"[{prefix}{time.strftime('%H:%M:%S')}] {message}", file=stream or sys.stderr, flush=True)

    return log


def utc_now() -> str:
    """Now, in UTC to the second (ISO 8601, ``+00:00``): the ``date`` of a result that keeps the time."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def today() -> str:
    """Today's local date, ``YYYY-MM-DD``: the ``date`` of a result that keeps the day only."""
    return dt.date.today().isoformat()


def write_json(path: str | Path, data: Any, *, indent: int = 2,
               default: Callable[[Any], Any] | None = None) -> Path:
    """Write ``data`` as JSON to ``path`` (its folder made if missing), ending in a newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=default) + "\n")
    return path


def rnd(value: float | None, digits: int = 3) -> float | None:
    """Rounded, and None for NaN/inf so the JSON stays standard."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def percentile(values: list[float], q: float) -> float:
    """The sample nearest to rank ``q``% of the sorted values (no interpolation: a measured value)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of at least two values, interpolated (``statistics``' inclusive method)."""
    q1, median, q3 = statistics.quantiles(sorted(values), n=4, method="inclusive")
    return q1, median, q3
