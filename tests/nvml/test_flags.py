"""Flags: defaults, environment fallbacks, one-line errors with exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuscope import cli
from gpuscope.nvml.config import COLLECTORS, parse, parse_duration


def test_defaults() -> None:
    cfg = parse([])
    assert cfg.listen == ("127.0.0.1", 9400)
    assert cfg.interval == 1.0 and cfg.slow_interval == 10.0 and cfg.call_timeout == 2.0
    assert cfg.collectors == {"device", "clock_events", "energy", "remapped_rows", "nvlink", "xid"}
    assert cfg.processes_max == 32


def test_flags_set_everything() -> None:
    cfg = parse(["--web.listen-address", "0.0.0.0:9500", "--sampling.interval=250ms",
                 "--sampling.slow-interval=1m", "--nvml.call-timeout=0.5", "--collector.processes",
                 "--processes.max=4", "--no-collector.xid", "--collector.pcie_throughput",
                 "--log.level=debug"])
    assert cfg.listen == ("0.0.0.0", 9500)
    assert (cfg.interval, cfg.slow_interval, cfg.call_timeout) == (0.25, 60.0, 0.5)
    assert "processes" in cfg.collectors and "pcie_throughput" in cfg.collectors
    assert "xid" not in cfg.collectors
    assert cfg.processes_max == 4 and cfg.log_level == "debug"


def test_every_flag_has_an_environment_variable(monkeypatch) -> None:
    monkeypatch.setenv("GPUSCOPE_WEB_LISTEN_ADDRESS", "[::1]:9401")
    monkeypatch.setenv("GPUSCOPE_SAMPLING_INTERVAL", "2s")
    monkeypatch.setenv("GPUSCOPE_SAMPLING_SLOW_INTERVAL", "30")
    monkeypatch.setenv("GPUSCOPE_NVML_CALL_TIMEOUT", "100ms")
    monkeypatch.setenv("GPUSCOPE_PROCESSES_MAX", "8")
    monkeypatch.setenv("GPUSCOPE_LOG_LEVEL", "warn")
    monkeypatch.setenv("GPUSCOPE_COLLECTOR_PROCESSES", "true")
    monkeypatch.setenv("GPUSCOPE_COLLECTOR_ENERGY", "false")
    cfg = parse([])
    assert cfg.listen == ("::1", 9401)
    assert (cfg.interval, cfg.slow_interval, cfg.call_timeout, cfg.processes_max) == (2.0, 30.0, 0.1, 8)
    assert cfg.log_level == "warning"  # warn and warning are one level for every command
    assert "processes" in cfg.collectors and "energy" not in cfg.collectors
    assert "energy" in parse(["--collector.energy"]).collectors  # a flag beats its variable


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--sampling.interval=fast"], "'fast' is not a duration"),
    (["--sampling.interval=0s"], "must be greater than zero"),
    (["--processes.max=0"], "must be at least 1"),
    (["--web.listen-address=localhost"], "is not HOST:PORT"),
    (["--log.level=loud"], "invalid choice"),
    (["--nvml.call-timeout=5m"], "over a minute"),
])
def test_bad_flags_give_one_line_and_exit_2(argv, needle, capsys) -> None:
    assert cli.main(["exporter", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("env, raw, needle", [
    ("GPUSCOPE_COLLECTOR_XID", "maybe", "is not a boolean"),
    ("GPUSCOPE_SAMPLING_INTERVAL", "soon", "is not a duration"),
])
def test_bad_environment_values_give_one_line(env, raw, needle, monkeypatch, capsys) -> None:
    monkeypatch.setenv(env, raw)
    assert cli.main(["exporter"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and env in err and needle in err, err


def test_help_lists_every_collector_with_its_variable(capsys) -> None:
    assert cli.main(["exporter", "--help"]) == 0
    out = capsys.readouterr().out
    for name in COLLECTORS:
        assert f"--collector.{name}" in out and f"GPUSCOPE_COLLECTOR_{name.upper()}" in out


@pytest.mark.parametrize("text, seconds", [
    ("1s", 1.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5), (".25s", 0.25)])
def test_durations(text, seconds) -> None:
    assert parse_duration(text) == seconds


def test_bad_flag_from_the_installed_command() -> None:
    result = subprocess.run([sys.executable, "-m", "gpuscope", "exporter", "--sampling.interval=x"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--sampling.interval" in result.stderr
