"""Start and stop ``gpuscope serve`` as a child process on a free local port.

The comparison command runs one server per configuration, and tests run a real
server the same way; both need it on 127.0.0.1 only, on a port nobody else
holds, ready (``/readyz``) before load starts, and gone afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from gpuscope.ports import free_port

READY_TIMEOUT_S = 120.0




class ServerError(RuntimeError):
    """The server exited or never became ready; the message ends with its last log lines."""


class ServerProcess:
    """``with ServerProcess(["--batch.max-size", "4"]) as server: server.url``."""

    def __init__(self, args: Sequence[str] = (), log_path: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gpuscope", "serve",
                "--web.listen-address", f"127.0.0.1:{self.port}", *self.args]

    def start(self) -> ServerProcess:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115  (closed in stop())
        else:
            self._log_file = subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
                                        env=self.env, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                self.stop()
                raise ServerError(f"gpuscope serve exited with {self.process.returncode}{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerError(f"gpuscope serve not ready after {self.ready_timeout_s:.0f}s{self._tail()}")

    def _tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
        return (": " + " | ".join(lines)) if lines else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the server drains), then SIGKILL if it has not gone within the timeout."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if self._log_file not in (None, subprocess.DEVNULL):
            self._log_file.close()  # type: ignore[union-attr]
        self._log_file = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
