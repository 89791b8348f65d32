"""Helpers of the share tests: tenant process environments, the launcher program, the fake driver's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpuscope.share.preload import library_path

HERE = Path(__file__).parent


def child_env(fake: Path, log: Path, *, preload: bool = True, tenant: str | None = None,
              ledger: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCOPE_SHARE") and k != "LD_PRELOAD"}
    env["LD_LIBRARY_PATH"] = str(fake)
    env["FAKE_CUDA_LOG"] = str(log)
    if preload:
        env["LD_PRELOAD"] = library_path()
    if tenant is not None:
        env["GPUSCOPE_SHARE_TENANT"] = tenant
    if ledger is not None:
        env["GPUSCOPE_SHARE_LEDGER"] = ledger
    return env


def launch(env: dict[str, str], n: int = 3, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "launcher.py"), str(n), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out), err


def read_log(log: Path) -> list[tuple[str, int, int]]:
    rows = []
    for line in log.read_text().splitlines():
        name, stream, seq = line.split()
        rows.append((name, int(stream), int(seq)))
    return rows
