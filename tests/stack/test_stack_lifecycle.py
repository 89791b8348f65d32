"""`gpuscope stack` as a script starts it: in the background (SIGINT ignored), in a reused run dir."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from gpuscope.ops import stack as st
from gpuscope.ops import stack_command
from tests.conftest import require_binary, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _old_run(run_dir: Path) -> list[Path]:
    """A run dir as a stack and a fleet leave it: data, configs and logs."""
    made = []
    for data in ("prometheus-data", "alertmanager-data", "central/victoria-metrics-data",
                 "hostA/vmagent-queue", "central/alertmanager-data"):
        (run_dir / data / "chunks").mkdir(parents=True)
        (run_dir / data / "chunks" / "000001").write_bytes(b"old series")
        made.append(run_dir / data)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "server.log").write_text("old log\n")
    (run_dir / "prometheus.yml").write_text("global: {}\n")
    (run_dir / "notes-data").mkdir()  # not a part's: stays
    return made


def test_clear_data_removes_each_parts_stored_data_and_nothing_else(tmp_path):
    made = _old_run(tmp_path)
    assert sorted(stack_command.clear_data(tmp_path)) == sorted(made)
    assert not any(path.exists() for path in made)
    assert (tmp_path / "logs" / "server.log").read_text() == "old log\n"
    assert (tmp_path / "prometheus.yml").exists() and (tmp_path / "notes-data").is_dir()
    assert stack_command.clear_data(tmp_path) == []  # nothing left to remove
    assert stack_command.clear_data(tmp_path / "never-made") == []


def test_clear_data_leaves_what_a_link_points_to(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "chunks").mkdir(parents=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "prometheus-data").symlink_to(elsewhere)
    assert stack_command.clear_data(run_dir) == []
    assert (elsewhere / "chunks").is_dir()


def test_keep_data_flag_and_its_environment_variable(monkeypatch):
    assert stack_command._parser().parse_settings([]).keep_data is False
    assert stack_command._parser().parse_settings(["--stack.keep-data"]).keep_data is True
    monkeypatch.setenv("GPUSCOPE_STACK_KEEP_DATA", "true")
    assert stack_command._parser().parse_settings([]).keep_data is True


def _alive(pid: int) -> bool:
    """Running, and not a zombie awaiting its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def _ignore_sigint() -> None:  # what a shell does for `cmd &` in a script
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.distro
@pytest.mark.parametrize("keep", [False, True], ids=["fresh", "keep-data"])
def test_background_stack_stops_on_sigint_with_every_part_gone_and_starts_without_old_data(tmp_path, keep):
    for binary in ("prometheus", "prometheus-alertmanager", "prometheus-node-exporter"):
        require_binary(binary)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = run_dir / "prometheus-data" / "chunks" / "000001"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"old series")
    out, err = tmp_path / "stack.out", tmp_path / "stack.err"
    argv = [sys.executable, "-m", "gpuscope", "stack", "--stack.free-ports", "--stack.run-dir", str(run_dir),
            *(["--stack.keep-data"] if keep else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with out.open("w") as stdout, err.open("w") as stderr:
        command = subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, cwd=ROOT,
                                   env=env, preexec_fn=_ignore_sigint)
    try:
        wait_for(lambda: "gpuscope stack is up" in out.read_text() or command.poll() is not None,
                 timeout=240, interval=0.5, what="the stack's summary")
        assert command.poll() is None, err.read_text()[-3000:]
        assert old.exists() is keep
        removed = f"removed {run_dir / 'prometheus-data'} of the last run"
        assert (removed in err.read_text()) is not keep
        prometheus = re.search(r"prometheus\s+(http://\S+)", out.read_text()).group(1)
        assert requests.get(prometheus + "/-/ready", timeout=10).status_code == 200
        parts = _children(command.pid)
        assert len(parts) == len(st.COMPONENTS), parts

        command.send_signal(signal.SIGINT)
        assert command.wait(timeout=120) == 0, err.read_text()[-3000:]
        text = err.read_text()
        assert "gpuscope stack: stopped" in text and "killing it" not in text, text[-3000:]
        wait_for(lambda: not any(_alive(pid) for pid in parts), timeout=30, interval=0.2,
                 what="every part gone")
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(timeout=30)
