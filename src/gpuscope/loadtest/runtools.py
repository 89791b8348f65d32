"""Small helpers the load-test commands share: durations as flags, and where Locust is."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpuscope.util.flags import checked, parse_duration

#: The locustfile both commands run (``loadtest/locustfile.py`` re-exports it).
LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def _duration_or_zero(text: str) -> float:
    return parse_duration(text, allow_zero=True)


#: ``30``, ``30s``, ``500ms``, ``2m`` → seconds, as a flag type (0 allowed: no warm-up).
duration_arg = checked(_duration_or_zero)


def locust_available() -> bool:
    return importlib.util.find_spec("locust") is not None


def locust_prefix() -> list[str]:
    """How to run Locust: with this Python, so no script directory has to be on PATH."""
    return [sys.executable, "-m", "locust"]


def locust_ignored_ctrl_c(child: Any) -> bool:
    """For ``procs.Child(signal_again=...)``: Locust logs "Shutting down" once it acts on a Ctrl-C
    (after writing its HTML report); without that line a second Ctrl-C is due."""
    return "Shutting down" not in child.tail(200)


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
