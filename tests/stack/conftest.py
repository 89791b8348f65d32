"""Fixtures for the stack's tests, and ``gpuscope stack`` run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscope.ops import procs
from gpuscope.util import freeport


@pytest.fixture
def free_port() -> int:
    return freeport.free_port()


class StackCommand:
    """``gpuscope stack ARGS --stack.run-dir RUN_DIR`` as a child process; a context manager.

    ``urls()`` reads the parts its summary lists, ``children()`` are its parts' processes, and
    ``stop_cleanly()`` sends SIGTERM and checks that the command and every part exited on it.
    """

    def __init__(self, run_dir: Path, *args: str) -> None:
        argv = [sys.executable, "-m", "gpuscope", "stack", *args, "--stack.run-dir", run_dir]
        self.child = procs.Child(argv, name="gpuscope stack", stdout=subprocess.PIPE,
                                 log_path=run_dir / "gpuscope-stack.err", grace_s=120)

    def __enter__(self) -> StackCommand:
        self.child.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.child.stop()

    def urls(self, last: str) -> dict[str, str]:
        """Part → URL from the summary it prints once every part is healthy, up to part ``last``."""
        urls: dict[str, str] = {}
        stdout = self.child.popen.stdout
        while last not in urls:
            line = stdout.readline()
            assert line or self.child.running, self.child.tail(30)
            if match := re.match(r"\s+([\w/-]+)\s+(http://\S+)", line):
                urls[match.group(1)] = match.group(2)
        return urls

    def children(self) -> list[int]:
        """The pids of the processes it started (its parts)."""
        found = subprocess.run(["pgrep", "-P", str(self.child.pid)], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]

    def stop_cleanly(self, children: list[int]) -> None:
        """SIGTERM: it exits 0 saying it stopped, no part needed SIGKILL, and none of ``children``
        outlived it (a zombie awaiting its reaper counts as gone)."""
        self.child.stop()
        err = self.child.output()
        assert self.child.poll() == 0, err
        assert "killing it" not in err and "gpuscope stack: stopped" in err, err
        for pid in children:
            stat = Path(f"/proc/{pid}/stat")
            assert not stat.parent.exists() or stat.read_text().split()[2] == "Z", f"part {pid} outlived it"
