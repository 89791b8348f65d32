"""Fixtures of the share tests: a fake libcuda built with gcc (helpers in fakecuda.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpuscope.share.preload import library_path
from tests.share.fakecuda import HERE


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory) -> Path:
    """A folder holding libcuda.so.1 (tests/share/fake_libcuda.c), libnvidia-ml.so.1
    (tests/share/fake_nvml.c) and a program linked against libcuda."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake libcuda")
    if library_path() is None:
        pytest.skip("the preload library is not built (python setup.py build_ext --inplace)")
    d = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(d / "libcuda.so.1"),
                    str(HERE / "fake_libcuda.c")], check=True)
    (d / "libcuda.so").symlink_to("libcuda.so.1")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(d / "libnvidia-ml.so.1"),
                    str(HERE / "fake_nvml.c")], check=True)
    subprocess.run(["gcc", "-o", str(d / "linked"), str(HERE / "linked_launcher.c"), f"-L{d}", "-lcuda",
                    "-ldl"], check=True)
    return d

