"""Small helpers the load-test commands share: durations as flags, and where Locust is."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
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


def describe_machine(label: str = "") -> str:
    """CPU count, Python, and the GPU nvidia-smi names (when there is one), after ``label``."""
    parts = [label] if label else []
    parts.append(f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            gpus = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=20).stdout.strip().splitlines()
            if gpus:
                parts.append(f"GPU: {gpus[0]}" + (f" (×{len(gpus)})" if len(gpus) > 1 else ""))
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "; ".join(parts)
