"""What the benchmark scripts share: progress lines, JSON-safe rounding and a percentile.

benchmarks/ is not a package: a script imports this as ``benchlib`` with its own folder on
``sys.path`` (where Python puts it when the script is run; a script that may be run otherwise, such
as through ``runpy``, puts it there itself).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable


def logger(tag: str) -> Callable[[str], None]:
    """``log(message)``: ``[TAG HH:MM:SS] message`` on stderr, flushed (stdout is for the report)."""

    def log(message: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return log


def rnd(value: float | None, digits: int = 3) -> float | None:
    """Rounded, and None for NaN/inf so the JSON stays standard."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def percentile(values: list[float], q: float) -> float:
    """The sample nearest to rank ``q``% of the sorted values (no interpolation: a measured value)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]
