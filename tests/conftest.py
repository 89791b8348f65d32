"""Shared test plumbing: GPU and distro-binary markers, a deadline poller, usage errors, benchmark runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

STRICT = os.environ.get("GPUSCOPE_STRICT") == "1"
T = TypeVar("T")
R = TypeVar("R")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):
        # A worker of `pytest -n` (scripts/test.sh, which hands out whole files: a module's fixture, a
        # fleet or a server, is started once). Files that start real services (slow tests, mostly
        # waiting) or distro binaries (promtool, the longest fixtures) go first, so that they overlap
        # the rest instead of ending the run. Every worker sorts alike; a file keeps its own order.
        def rank(item: pytest.Item) -> int:
            return 0 if module_of(item) in slow else 1 if module_of(item) in distro else 2

        slow = {module_of(item) for item in items if "slow" in item.keywords}
        distro = {module_of(item) for item in items if "distro" in item.keywords}
        items.sort(key=rank)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run the gpu-marked tests on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def require_binary(name: str) -> str:
    """Path of a distro binary; skips without it, or fails when GPUSCOPE_STRICT=1 (CI)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found (Debian: see scripts/test.sh for the package)"
        if STRICT:
            pytest.fail(message + " and GPUSCOPE_STRICT=1")
        pytest.skip(message)
    return path


def wait_for(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> T:
    """Poll ``check`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T = check()
    while not last:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or check}")
        time.sleep(interval)
        last = check()
    return last


def usage_error(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """The line ``python -m ARGV`` prints for a usage error. Fails unless it exits 2 with exactly one
    line on stderr: every gpuscope command checks its flags before it starts anything."""
    result = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout,
                            env=env)
    return usage_line(result)


def usage_line(result: subprocess.CompletedProcess[str]) -> str:
    """``usage_error``'s check of a finished ``python -m ARGV``: its one line."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, f"exit status {result.returncode}:\n{result.stderr}"
    return lines[0]


def selected(request: pytest.FixtureRequest, test: str, param: str) -> list:
    """The values of ``param`` of the requesting module's ``test`` that this session runs: what a
    module fixture computes for its parametrized tests (a -k run computes only its own)."""
    return [item.callspec.params[param] for item in request.session.items
            if getattr(item, "originalname", None) == test and item.module is request.module]


def side_by_side(run: Callable[[T], R], items: list[T]) -> dict[T, R]:
    """``run(item)`` for every item, as many at a time as there are CPUs: for independent child
    processes that each keep one core busy (promtool, a command that loads torch before it answers)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(items), os.cpu_count() or 1))) as pool:
        return dict(zip(items, pool.map(run, items), strict=True))


def run_bench(script: Path, tmp_path: Path, *args: str, status: int = 0,
              timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``python SCRIPT --quick --out JSON ARGS`` (a benchmark's CPU smoke run): its output and the JSON
    report it wrote, failing with the end of its output unless it exits with ``status``."""
    out = tmp_path / f"{script.stem}.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def promtool_check_metrics(exposition: str | bytes) -> None:
    """Fail the test unless ``promtool check metrics`` accepts this exposition (lint warnings included)."""
    promtool = require_binary("promtool")
    data = exposition.encode() if isinstance(exposition, str) else exposition
    result = subprocess.run([promtool, "check", "metrics"], input=data, capture_output=True, timeout=60)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
