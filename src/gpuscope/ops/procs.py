"""Child processes started, waited for and stopped the same way everywhere.

The stack, the fleet, the load-test commands, the benchmarks and the tests all run real programs
as children (servers, Prometheus, Locust...). Each needs the same four things, and each got one of
them subtly wrong when it was written on its own, so they live here once:

* **Output to a file, never to an unread pipe.** A child writing to a pipe nobody drains blocks
  for good once the pipe's buffer (64 KiB on Linux) is full: a server that logs a little more than
  usual hangs mid-request. Output goes to ``log_path``, or to an unnamed temporary file, so there
  is always a tail to show and nothing to drain.
* **Readiness against a deadline, failing early.** Polling a URL or a predicate until a deadline,
  but a child that exits meanwhile fails the wait at once, with the last lines it wrote, instead of
  making its caller sit out the whole timeout to learn nothing.
* **A stop that is graceful first and certain last.** The chosen signal first (SIGTERM for
  servers, which drain; SIGINT for Locust, which writes its reports only on Ctrl-C), SIGKILL after a
  grace period; calling it again, or on a child that already exited, is harmless.
* **The tail of its output** for error messages, from this start only (a log file that a restart
  appends to does not show the previous run's last words).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: How long a stopped child may take to exit on its first signal before it is killed.
DEFAULT_GRACE_S = 15.0
#: With ``signal_again``: how long after a stop signal it is sent again to a child not acting on it.
SIGNAL_AGAIN_AFTER_S = 10.0
#: Readiness poll interval: short against start-up times of seconds, long enough not to busy a CPU.
POLL_INTERVAL_S = 0.2
#: How much of the end of a child's output :meth:`Child.tail` reads at most.
_TAIL_BYTES = 64 * 1024

Check = Callable[[], Any]


class ChildError(RuntimeError):
    """A child exited while it was being waited for, or was not ready by the deadline.

    The message names the child and ends with the last lines of its output.
    """


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET url`` answers 200. Refused connections and errors are "not yet", not failures:
    a child that is starting has not bound its port."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _libc_prctl_pdeathsig() -> None:
    # Ask Linux to SIGTERM this child when the thread that started it dies, so children do not
    # outlive a parent that is killed hard (a test run stopped with SIGKILL, say).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _restore_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored and an ignored signal stays ignored across
    # exec: a Python child would never turn SIGINT into KeyboardInterrupt, so a graceful Ctrl-C stop
    # would do nothing. Give the child the disposition a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Child:
    """One child process: ``start()``, ``wait_ready()``, ``stop()``; a context manager.

    ``argv``, ``env`` (the whole environment; None: this process's) and ``cwd`` are Popen's.
    stdout and stderr go to ``log_path`` (appended to: a restart keeps the earlier run's lines) or,
    without one, to a temporary file (``stop()`` keeps its last 64 KiB); ``stdout=subprocess.PIPE`` hands
    stdout to the caller instead (``popen.stdout``, text), who must then read it. ``stdin`` defaults
    to /dev/null so a child never waits on our terminal; ``stdin=subprocess.PIPE`` gives
    ``popen.stdin``. ``stop()`` closes these pipes.

    ``ready`` is what :meth:`wait_ready` polls: a URL that must answer 200, or a callable whose
    truthy result means ready (OSError from it means "not yet"). ``stop_signal`` and ``grace_s`` are
    how :meth:`stop` ends it. ``new_session`` puts the child in its own session, so a Ctrl-C at the
    terminal reaches only the parent, which then stops its children in its own order;
    ``die_with_parent`` asks Linux to SIGTERM the child if the parent dies first (it fires when the
    starting *thread* exits: only for children started from a long-lived thread). ``signal_again``,
    asked every ``SIGNAL_AGAIN_AFTER_S`` of the grace period, says whether the child still has not
    acted on its stop signal, which is then sent again, as a person presses Ctrl-C twice (Locust was
    seen to run on after one SIGINT with all its users blocked).
    """

    def __init__(self, argv: Sequence[str], *, name: str | None = None, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, log_path: str | os.PathLike[str] | None = None,
                 stdin: int | None = subprocess.DEVNULL, stdout: int | None = None,
                 ready: str | Check | None = None, stop_signal: int = signal.SIGTERM,
                 grace_s: float = DEFAULT_GRACE_S, new_session: bool = False,
                 die_with_parent: bool = False, signal_again: Callable[[Child], bool] | None = None) -> None:
        self.argv = [str(arg) for arg in argv]
        self.name = name or Path(self.argv[0]).name
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.log_path = Path(log_path) if log_path is not None else None
        self.ready = ready
        self.stop_signal = stop_signal
        self.grace_s = grace_s
        self.signal_again = signal_again
        self.popen: subprocess.Popen[str] | None = None
        self._stdin, self._stdout = stdin, stdout
        self._new_session, self._die_with_parent = new_session, die_with_parent
        self._output: IO[bytes] | None = None  # the file output goes to, kept open for tail()
        self._output_start = 0  # where this start's output begins in it
        self._started = False  # since the last stop()
        self._kept_output = ""  # the end of a temporary output file, read as stop() removes it

    # -- life cycle --

    def start(self) -> Child:
        """Start the child (again, after a stop: same command, same log). Returns self."""
        if self.running:
            raise ChildError(f"{self.name} is already running (pid {self.pid})")
        self._close_output()
        self._kept_output = ""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._output = self.log_path.open("ab+")
        else:
            self._output = tempfile.TemporaryFile()  # noqa: SIM115  (closed by stop())
        self._output_start = os.fstat(self._output.fileno()).st_size
        try:
            self.popen = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=self._stdin,
                stdout=self._output if self._stdout is None else self._stdout, stderr=self._output,
                text=True, start_new_session=self._new_session, preexec_fn=self._preexec())
        except BaseException:
            self._close_output()
            raise
        self._started = True
        return self

    def _preexec(self) -> Callable[[], None] | None:
        # preexec_fn is only set when needed: it is not safe with threads in every case, and it
        # makes Popen slower (no vfork).
        steps = []
        if self._die_with_parent and sys.platform.startswith("linux"):
            steps.append(_libc_prctl_pdeathsig)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            steps.append(_restore_sigint)
        if not steps:
            return None

        def preexec() -> None:
            for step in steps:
                step()

        return preexec

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def poll(self) -> int | None:
        """The exit status once the child has exited (negative: the signal that ended it), else None."""
        return None if self.popen is None else self.popen.poll()

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait up to ``timeout_s`` for the child to exit by itself; its status, or None if it runs on."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, timeout_s: float, interval_s: float = POLL_INTERVAL_S) -> Any:
        """Poll ``ready`` until it holds; its (truthy) result. ChildError, with the output's tail, as
        soon as the child exits, or when ``timeout_s`` passes first."""
        return wait_all({self.name: self}, timeout_s, interval_s=interval_s)[self.name]

    def stop(self, stop_signal: int | None = None, grace_s: float | None = None,
             on_kill: Callable[[Child], None] | None = None) -> int | None:
        """``stop_signal`` (default: the child's), then SIGKILL after ``grace_s``; the exit status.

        Idempotent: a child that has exited, or never started, is only reaped and its files closed.
        """
        stop_all([self], stop_signal, grace_s, on_kill)
        return self.poll()

    def kill(self) -> None:
        """SIGKILL now without waiting (for a watchdog that is about to exit the process)."""
        if self.running:
            with contextlib.suppress(OSError):
                self.popen.kill()  # type: ignore[union-attr]

    def __enter__(self) -> Child:
        return self if self._started else self.start()  # ``with child.start():`` works too

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- output --

    def output(self) -> str:
        """Everything the child wrote since this start (for a test's assertions on a short run).
        Without ``log_path``, once stopped: only the last 64 KiB of it."""
        return self._read_output(None)

    def tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines the child wrote since this start ("" when none)."""
        text = self._read_output(_TAIL_BYTES)
        return "\n".join(text.splitlines()[-lines:])

    def _read_output(self, most: int | None) -> str:
        if self._output is None or self._output.closed:
            if self.log_path is None:
                return self._kept_output if most is None else self._kept_output[-most:]
            try:  # stopped: the log is still there to read
                with self.log_path.open("rb") as log:
                    return self._read_from(log, most)
            except OSError:
                return ""
        return self._read_from(self._output, most)

    def _read_from(self, file: IO[bytes], most: int | None) -> str:
        # pread: the child shares the file's offset with us, and must go on writing at its end.
        end = os.fstat(file.fileno()).st_size
        start = self._output_start if most is None else max(self._output_start, end - most)
        return os.pread(file.fileno(), max(0, end - start), start).decode(errors="replace")

    def _close_output(self) -> None:
        if self._output is not None:
            self._output.close()
            self._output = None

    def _close_files(self) -> None:
        # After a stop: our pipes to the child, and the output file. A temporary one is gone then:
        # its last part is kept, so tail() can still say why a stopped child failed.
        if self.log_path is None and self._output is not None:
            self._kept_output = self._read_output(_TAIL_BYTES)
        for pipe in (self.popen.stdin, self.popen.stdout) if self.popen is not None else ():
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._close_output()
        self._started = False

    def describe_failure(self, what: str, name: str | None = None) -> str:
        """``NAME WHAT; last lines of LOG:`` and the tail, or ``NAME WHAT (no output)``."""
        tail = self.tail()
        name = name or self.name
        if not tail:
            return f"{name} {what} (no output)"
        where = self.log_path if self.log_path is not None else "its output"
        return f"{name} {what}; last lines of {where}:\n{tail}"


def _check(child: Child) -> Any:
    ready = child.ready
    if ready is None:
        return True  # nothing to wait for: started is ready
    if isinstance(ready, str):
        return http_ok(ready)
    try:
        return ready()
    except OSError:  # a connection refused or reset while the child is coming up
        return None


def wait_all(children: Mapping[str, Child], timeout_s: float, *, interval_s: float = POLL_INTERVAL_S,
             on_ready: Callable[[str, float], None] | None = None,
             on_waiting: Callable[[list[str], float], None] | None = None,
             waiting_every_s: float = 10.0) -> dict[str, Any]:
    """Poll every child's ``ready`` until all hold; each one's result, by key.

    Keys name the children in messages. ``on_ready(key, seconds)`` is called as each becomes ready
    and ``on_waiting(keys, seconds)`` every ``waiting_every_s`` while some are not. ChildError as
    soon as one exits (its status and output's tail), or at the deadline (the first one pending).
    """
    pending = dict(children)
    results: dict[str, Any] = {}
    start = time.monotonic()
    deadline = start + timeout_s
    last_report = start
    while pending:
        for key, child in list(pending.items()):
            code = child.poll()
            if code is not None:
                raise ChildError(child.describe_failure(f"exited with status {code} while starting", key))
            value = _check(child)
            if value:
                results[key] = value
                del pending[key]
                if on_ready is not None:
                    on_ready(key, time.monotonic() - start)
        now = time.monotonic()
        if not pending:
            break
        if now > deadline:
            first = next(iter(pending.values()))
            raise ChildError(first.describe_failure(f"not ready after {timeout_s:g}s", ", ".join(pending)))
        if on_waiting is not None and now - last_report >= waiting_every_s:
            on_waiting(list(pending), now - start)
            last_report = now
        time.sleep(interval_s)
    return results


def _signal_again_until(child: Child, stop_signal: int, signalled_at: float, deadline: float) -> None:
    """Wait for ``child`` to exit until ``deadline``, resending ``stop_signal`` every
    ``SIGNAL_AGAIN_AFTER_S`` while its ``signal_again`` says it has not acted on it."""
    again_at = signalled_at + SIGNAL_AGAIN_AFTER_S
    while child.running and (now := time.monotonic()) < deadline:
        if now >= again_at:
            again_at = now + SIGNAL_AGAIN_AFTER_S
            if child.signal_again(child):  # type: ignore[misc]
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(stop_signal)  # type: ignore[union-attr]
        child.wait(max(0.01, min(again_at, deadline) - time.monotonic()))


def stop_all(children: Iterable[Child], stop_signal: int | None = None, grace_s: float | None = None,
             on_kill: Callable[[Child], None] | None = None) -> None:
    """Stop children together: each one's signal to all first, then one shared grace period, then
    SIGKILL for what is left (``on_kill(child)`` first, to say so). Children are signalled in the
    order given: list the ones that depend on others first. Exited children are only reaped."""
    children = list(children)
    signalled = []
    for child in children:
        if child.running:
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(stop_signal or child.stop_signal)  # type: ignore[union-attr]
            signalled.append(child)
    signalled_at = time.monotonic()
    for child in signalled:
        deadline = signalled_at + (child.grace_s if grace_s is None else grace_s)
        if child.signal_again is not None:
            _signal_again_until(child, stop_signal or child.stop_signal, signalled_at, deadline)
        if child.wait(max(0.1, deadline - time.monotonic())) is None:
            if on_kill is not None:
                on_kill(child)
            child.kill()
            child.wait(30)  # SIGKILL cannot be refused; only a hung device driver makes this time out
    for child in children:
        child._close_files()
