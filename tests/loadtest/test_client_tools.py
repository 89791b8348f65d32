"""guidellm and aiperf against gpuscope serve with their default request format.

Both pull their own torch, so they live in their own virtual environments, never the test
environment: name their executables in ``GPUSCOPE_GUIDELLM`` and ``GPUSCOPE_AIPERF`` to run these
(``benchmarks/client_tools_run.py`` says how to install them); without those variables the tests skip.
A run passes when the tool exits 0 and the server finished every request it sent, none failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from client_tools_run import run

REQUESTS = 6


@pytest.mark.parametrize("tool", ["guidellm", "aiperf"])
def test_tool_with_default_request_format(tool, tmp_path):
    binary = os.environ.get(f"GPUSCOPE_{tool.upper()}")
    if not binary or not Path(binary).is_file():
        pytest.skip(f"set GPUSCOPE_{tool.upper()} to a {tool} executable to run this")
    # max_tokens: the server's limit must admit guidellm's 32 output tokens (over it: 400, and guidellm
    # still exits 0, which the server's count catches).
    args = argparse.Namespace(guidellm=None, aiperf=None, requests=REQUESTS, max_tokens=64, timeout=600.0,
                              out=tmp_path / "out.json")
    setattr(args, tool, binary)
    report = run(args)["tools"][tool]
    assert report["exit_code"] == 0, report.get("output_tail")
    assert report["server"]["length"] + report["server"]["stop"] == REQUESTS, report
    assert report["ok"], report
