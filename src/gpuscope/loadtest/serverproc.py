"""Start and stop ``gpuscope serve`` as a child process on a free local port.

The comparison command runs one server per configuration, and tests run a real
server the same way; both need it on 127.0.0.1 only, on a port nobody else
holds, ready (``/readyz``) before load starts, and gone afterwards. The child
itself is a gpuscope.ops.procs.Child.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from gpuscope.ops import procs
from gpuscope.util.freeport import free_port

READY_TIMEOUT_S = 120.0


class ServerError(procs.ChildError):
    """The server exited or never became ready; the message ends with its last log lines."""


class ServerProcess:
    """``with ServerProcess(["--batch.max-size", "4"]) as server: server.url``.

    ``start()`` returns once the server is ready; to start several at once and let them load
    together, ``launch()`` each and then ``wait_ready()`` each. ``name`` is the server in messages.
    """

    def __init__(self, args: Sequence[str] = (), log_path: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
                 name: str = "gpuscope serve") -> None:
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.child = procs.Child(self.command(), name=name, env=self.env, log_path=self.log_path,
                                 ready=self.url + "/readyz", new_session=True)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gpuscope", "serve",
                "--web.listen-address", f"127.0.0.1:{self.port}", *self.args]

    def start(self) -> ServerProcess:
        """Start the server and wait until it is ready; ServerError (and nothing left running) if not."""
        return self.launch().wait_ready()

    def launch(self) -> ServerProcess:
        """Start the server without waiting for it."""
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)  # a run's log holds that run only
        self.child.start()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> ServerProcess:
        """Wait until ``/readyz`` answers (default: ``ready_timeout_s``); ServerError, with the log's
        last lines, and the server stopped, if it exits or is not ready in time."""
        try:
            self.child.wait_ready(self.ready_timeout_s if timeout_s is None else timeout_s)
        except procs.ChildError as exc:
            self.stop()
            raise ServerError(str(exc)) from None
        return self

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the server drains), then SIGKILL if it has not gone within the timeout."""
        self.child.stop(grace_s=timeout_s)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
