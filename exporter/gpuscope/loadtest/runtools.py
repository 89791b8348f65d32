"""Small helpers the load-test commands share: durations as flags, and where Locust is."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

#: The locustfile both commands run (``loadtest/locustfile.py`` re-exports it).
LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def duration_arg(raw: str) -> float:
    """``30``, ``30s``, ``2m`` → seconds."""
    text = raw.strip().lower()
    factor = 60.0 if text.endswith("m") else 1.0
    number = text.rstrip("sm")
    try:
        value = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a duration (e.g. 30s, 2m)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{raw!r} is negative")
    return value


def locust_available() -> bool:
    return importlib.util.find_spec("locust") is not None


def locust_prefix() -> list[str]:
    """How to run Locust: with this Python, so no script directory has to be on PATH."""
    return [sys.executable, "-m", "locust"]
