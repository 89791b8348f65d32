"""``gpuscope COMMAND``: one command line for every part, the load tests included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscope import cli
from gpuscope.loadtest import run as loadtest_run
from gpuscope.loadtest.runtools import LOCUSTFILE, locust_available
from tests.conftest import usage_error

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def gpuscope(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuscope", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_help_lists_every_command_with_its_summary():
    result = gpuscope("--help")
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(cli.COMMANDS)
    assert {"exporter", "serve", "receiver", "stack", "generate", "loadtest", "compare", "drill"} <= listed


@pytest.mark.parametrize("command, module", [("compare", "gpuscope.loadtest.compare"),
                                             ("drill", "gpuscope.loadtest.fault_drill")])
def test_load_commands_answer_help_under_their_gpuscope_name(command, module):
    result = gpuscope(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: gpuscope {command} "), result.stdout[:200]
    # The module form stays, with the same flags.
    module_form = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                                 timeout=120, env=ENV)
    assert module_form.returncode == 0
    assert module_form.stdout.split("\n", 1)[1] == result.stdout.split("\n", 1)[1]


@pytest.mark.parametrize("command, flag", [("compare", "--repeats"), ("drill", "--scenarios-typo")])
def test_load_commands_reject_a_bad_flag_in_one_line(command, flag):
    line = usage_error("gpuscope", command, flag, "x", env=ENV)
    assert line.startswith(f"gpuscope {command}: error:"), line


def test_unknown_command_names_the_real_ones():
    result = gpuscope("loadtests")
    assert result.returncode == 2
    assert "unknown command 'loadtests'" in result.stderr and "loadtest" in result.stderr


def test_loadtest_runs_the_bundled_locustfile_against_the_default_server():
    argv = loadtest_run.locust_argv(["--headless", "-u", "2"])
    assert argv[argv.index("-f") + 1] == str(LOCUSTFILE)
    assert argv[argv.index("--host") + 1] == "http://127.0.0.1:8000"
    assert argv[-3:] == ["--headless", "-u", "2"]


@pytest.mark.parametrize("host", [["--host", "http://gpu-1:8000"], ["--host=http://gpu-1:8000"],
                                  ["-H", "http://gpu-1:8000"], ["-Hhttp://gpu-1:8000"]])
def test_loadtest_keeps_a_given_host(host):
    argv = loadtest_run.locust_argv(host)
    assert argv.count("--host") + argv.count("-H") <= 1 and loadtest_run.DEFAULT_HOST not in argv
    assert argv[-len(host):] == host


def test_loadtest_refuses_another_locustfile():
    result = gpuscope("loadtest", "-f", "mine.py")
    assert result.returncode == 2
    assert result.stderr.strip() == ("gpuscope loadtest: error: '-f': gpuscope loadtest runs the bundle's "
                                     "locustfile; for your own, run locust -f")


@pytest.mark.skipif(not locust_available(), reason="Locust is not installed (gpuscope[loadtest])")
def test_loadtest_help_is_locusts():
    result = gpuscope("loadtest", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("gpuscope loadtest: Locust with gpuscope's locustfile")
    assert "--headless" in result.stdout  # Locust's own flag: Locust answered, not a stub
