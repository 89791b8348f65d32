"""Fixtures of the share tests: a fake libcuda built with gcc, and tenant process environments."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscope.share.preload import library_path

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory) -> Path:
    """A folder holding libcuda.so.1 (tests/share/fake_libcuda.c) and a program linked against it."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake libcuda")
    if library_path() is None:
        pytest.skip("the preload library is not built (python setup.py build_ext --inplace)")
    d = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(d / "libcuda.so.1"),
                    str(HERE / "fake_libcuda.c")], check=True)
    (d / "libcuda.so").symlink_to("libcuda.so.1")
    subprocess.run(["gcc", "-o", str(d / "linked"), str(HERE / "linked_launcher.c"), f"-L{d}", "-lcuda",
                    "-ldl"], check=True)
    return d


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
