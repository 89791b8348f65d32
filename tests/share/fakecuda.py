"""Helpers of the share tests: tenant process environments, the launcher program, the fake driver's log."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
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


def helper_folder(pid: int) -> str | None:
    """/proc folder of process ``pid``'s gpuscope-share helper thread (None: none found)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == "gpuscope-share":
                    return f"/proc/{pid}/task/{tid}"
        except OSError:
            continue
    return None


def read_log(log: Path) -> list[tuple[str, int, int]]:
    rows = []
    for line in log.read_text().splitlines():
        name, stream, seq = line.split()
        rows.append((name, int(stream), int(seq)))
    return rows


class Joined:
    """The tenant processes that joined a bare ``Policy`` (no controller loop to adopt them), by pid."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.views: dict[int, object] = {}
        self.events: list[tuple[str, int]] = []

    def poll(self) -> dict[int, object]:
        for event in self.policy.take_joins():
            self.events.append((event.kind, event.pid))
            if event.kind == "join":
                self.views[event.pid] = event.page
            elif event.pid in self.views:
                self.views.pop(event.pid).close()
        return self.views

    def one(self, timeout: float = 15.0):
        """The one joined process's page, once it has joined."""
        from tests.conftest import wait_for

        wait_for(lambda: len(self.poll()) == 1, timeout=timeout, what="the tenant to join")
        return next(iter(self.views.values()))

    def close(self) -> None:
        for view in self.views.values():
            view.close()
        self.views.clear()


@contextlib.contextmanager
def running_controller(prefix: str, tenants, *, access=None, policy_file=None, **flags):
    """A Controller with its loop in a thread, closed at the end. ``flags``: settings by their names
    in ShareSettings (``slice=0.01``, ``handover=Handover.OVERLAP``...), over the command's defaults."""
    from gpuscope.share.controller import Controller
    from gpuscope.share.settings import ShareSettings

    settings = dataclasses.replace(ShareSettings(), **flags)
    c = Controller(prefix, tenants, settings, access=access, policy_file=policy_file, log=lambda line: None)
    stop = threading.Event()
    loop = threading.Thread(target=c.run, args=(stop,))
    loop.start()
    try:
        yield c
    finally:
        stop.set()
        loop.join()
        c.close()


class Tenant:
    """tests/share/allocator.py as a tenant process, driven one command at a time."""

    def __init__(self, fake: Path, tmp_path: Path, name: str, ledger: str, memory: str | None = None) -> None:
        env = child_env(fake, os.devnull, tenant=name, ledger=ledger)
        if memory is not None:  # its own cap, as the admission webhook sets it from an annotation
            env["GPUSCOPE_SHARE_MEMORY"] = memory
        self.p = subprocess.Popen([sys.executable, str(HERE / "allocator.py")], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        self.err: str | None = None

    def ask(self, *command) -> object:
        self.p.stdin.write(json.dumps(command) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read()
        return json.loads(line)

    def close(self) -> str:
        """Its stderr, once it has exited (asked to, if it still runs)."""
        if self.err is None:
            if self.p.poll() is None:
                self.p.stdin.write('["exit"]\n')
                self.p.stdin.close()
            self.p.wait(30)
            self.err = self.p.stderr.read()
            self.p.stdout.close()
            self.p.stderr.close()
        return self.err
