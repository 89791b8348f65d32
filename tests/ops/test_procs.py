"""gpuscope.ops.procs with real children (tiny Python programs): start, readiness, stop, output.

Every wait is on something the child does (a file it writes once it is in the state the test needs,
a port it answers on), polled against a deadline far longer than a busy machine needs; nothing
sleeps and hopes.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from gpuscope.ops import procs
from gpuscope.util.freeport import free_port

#: Generous: a Python child on a loaded 2-core machine can take seconds to start.
DEADLINE_S = 120.0


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]


def marker_ready(path: Path):
    """A readiness check: the child wrote ``path`` (it does so once it is in the wanted state)."""
    return lambda: path.exists()


#: Writes argv[1] once its handlers are in place, then waits to be signalled.
WAITER = """
import pathlib, signal, sys, time
{setup}
pathlib.Path(sys.argv[1]).write_text("ready")
while True:
    signal.pause()
"""


def waiter(tmp_path: Path, setup: str = "", **kwargs) -> procs.Child:
    marker = tmp_path / "ready"
    return procs.Child(python(WAITER.format(setup=setup), marker), ready=marker_ready(marker), **kwargs)


def test_ready_on_a_url_and_stopped_with_sigterm(tmp_path):
    port = free_port()
    code = ("import http.server, sys; http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), "
            "http.server.SimpleHTTPRequestHandler).serve_forever()")
    child = procs.Child(python(code, port), cwd=tmp_path, ready=f"http://127.0.0.1:{port}/", name="web")
    assert not procs.http_ok(f"http://127.0.0.1:{port}/")  # nothing listens before the start
    with child:
        assert child.wait_ready(DEADLINE_S) is True
        assert child.running and procs.http_ok(f"http://127.0.0.1:{port}/")
    assert child.poll() == -signal.SIGTERM
    assert not child.running


def test_a_child_that_exits_fails_the_wait_at_once_with_its_last_lines(tmp_path):
    code = "import sys; print('starting'); sys.stderr.write('boom: no such model\\n'); sys.exit(3)"
    child = procs.Child(python(code), name="server", log_path=tmp_path / "server.log",
                        ready=lambda: False)
    started = time.monotonic()
    with child, pytest.raises(procs.ChildError) as caught:
        child.wait_ready(DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S  # it did not sit out the deadline
    message = str(caught.value)
    assert message.startswith("server exited with status 3 while starting; last lines of ")
    assert str(tmp_path / "server.log") in message and message.endswith("starting\nboom: no such model")


def test_a_child_not_ready_by_the_deadline_fails_naming_it(tmp_path):
    child = waiter(tmp_path, name="slow")
    child.ready = lambda: False
    with child:
        with pytest.raises(procs.ChildError, match=r"^slow not ready after 0\.5s") as caught:
            child.wait_ready(0.5)
        assert child.running  # the caller decides what to do with it; stop() ends it
    assert "no output" in str(caught.value)


def graceful_waiter(tmp_path: Path) -> procs.Child:
    """A waiter that writes ``done`` as Python unwinds from a KeyboardInterrupt (a signal's default
    action would end it without): as Locust writes its reports only on Ctrl-C."""
    done = str(tmp_path / "done")
    setup = f"import atexit\natexit.register(lambda: pathlib.Path({done!r}).write_text('reports written'))"
    return waiter(tmp_path, setup, stop_signal=signal.SIGINT, grace_s=DEADLINE_S)


def test_sigint_stop_is_graceful(tmp_path):
    with graceful_waiter(tmp_path) as child:
        child.wait_ready(DEADLINE_S)
    assert child.poll() == -signal.SIGINT  # how Python exits after an unhandled KeyboardInterrupt
    assert (tmp_path / "done").read_text() == "reports written"


def test_sigint_reaches_a_child_started_while_sigint_is_ignored(tmp_path):
    """A shell's background job runs with SIGINT ignored and its children inherit that: a graceful
    Ctrl-C stop would do nothing and end in SIGKILL. The child gets the default back."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = graceful_waiter(tmp_path).start()
    finally:
        signal.signal(signal.SIGINT, previous)
    killed = []
    with child:
        child.wait_ready(DEADLINE_S)
        child.stop(on_kill=killed.append)
    assert not killed
    assert (tmp_path / "done").read_text() == "reports written"


def test_a_child_that_ignores_its_signal_is_killed_after_the_grace_period(tmp_path):
    child = waiter(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)", grace_s=0.5)
    killed = []
    with child:
        child.wait_ready(DEADLINE_S)
        assert child.stop(on_kill=killed.append) == -signal.SIGKILL
    assert killed == [child]


#: Acts only on its second SIGTERM, like a program that missed the first one.
SECOND_SIGNAL = """
seen = []
def on_term(signum, frame):
    seen.append(signum)
    if len(seen) == 2:
        raise SystemExit(0)
signal.signal(signal.SIGTERM, on_term)
"""


@pytest.mark.parametrize("again", [True, False], ids=["not-acted-on", "acting-on-it"])
def test_a_stop_signal_not_acted_on_is_sent_again_when_asked(tmp_path, monkeypatch, again):
    monkeypatch.setattr(procs, "SIGNAL_AGAIN_AFTER_S", 0.2)
    asked = []

    def signal_again(child: procs.Child) -> bool:
        asked.append(child)
        return again

    child = waiter(tmp_path, SECOND_SIGNAL, grace_s=3.0, signal_again=signal_again)
    killed = []
    with child:
        child.wait_ready(DEADLINE_S)
        status = child.stop(on_kill=killed.append)
    assert asked and asked[0] is child
    if again:  # the second signal ended it well before the grace period
        assert (status, killed) == (0, [])
    else:  # a child that says it is stopping is left to it, then killed at the end of the grace
        assert (status, killed) == (-signal.SIGKILL, [child])


def test_stop_is_idempotent(tmp_path):
    never_started = procs.Child(python("pass"))
    assert never_started.stop() is None
    child = procs.Child(python("print('bye')")).start()
    assert child.wait(DEADLINE_S) == 0
    assert child.stop() == 0  # exited by itself: only reaped
    assert child.stop() == 0
    assert child.tail() == "bye"  # its temporary output file is gone; the end of it is kept
    running = waiter(tmp_path).start()
    running.wait_ready(DEADLINE_S)
    assert running.stop() == running.stop() == -signal.SIGTERM


def test_much_output_never_blocks_the_child(tmp_path):
    """4 MiB on stdout and stderr, far over a pipe's 64 KiB: the child still gets to its marker."""
    marker = tmp_path / "ready"
    code = ("import pathlib, sys\n"
            "for i in range(32768): print('x' * 63); sys.stderr.write('y' * 63 + '\\n')\n"
            "print('last line', flush=True)\n"
            "pathlib.Path(sys.argv[1]).write_text('ready')\n"
            "import time; time.sleep(3600)\n")
    with procs.Child(python(code, marker), ready=marker_ready(marker)) as child:
        child.wait_ready(DEADLINE_S)
        assert child.tail(1) == "last line"
        assert len(child.tail(10_000).splitlines()) <= 1100  # the tail reads the end, not everything
        assert len(child.output()) == 32768 * 64 * 2 + len("last line\n")


def test_the_tail_is_of_this_start_only(tmp_path):
    log = tmp_path / "part.log"
    child = procs.Child(python("import sys; print(sys.argv[1])", "first run"), log_path=log)
    with child:
        assert child.wait(DEADLINE_S) == 0
        assert child.tail() == "first run"
    child.argv[-1] = "second run"
    with child:
        assert child.wait(DEADLINE_S) == 0
        assert child.tail() == "second run"
    assert child.tail() == "second run"  # stopped: read back from the log
    assert log.read_text() == "first run\nsecond run\n"  # a restart appends


def test_start_refuses_a_running_child_and_restarts_a_stopped_one(tmp_path):
    child = waiter(tmp_path)
    with child:
        child.wait_ready(DEADLINE_S)
        with pytest.raises(procs.ChildError, match="already running"):
            child.start()
    (tmp_path / "ready").unlink()
    with child.start():
        child.wait_ready(DEADLINE_S)
        assert child.running


def test_wait_all_reports_each_ready_child_and_stop_all_stops_them_together(tmp_path):
    children = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        children[name] = waiter(tmp_path / name, name=name).start()
    ready: list[str] = []
    try:
        results = procs.wait_all(children, DEADLINE_S, on_ready=lambda key, seconds: ready.append(key))
        assert results == {"a": True, "b": True} and sorted(ready) == ["a", "b"]
    finally:
        procs.stop_all(children.values())
    assert [c.poll() for c in children.values()] == [-signal.SIGTERM, -signal.SIGTERM]


def test_pipes_to_the_child(tmp_path):
    """stdin and stdout as pipes: the caller talks to the child; stop() closes them."""
    import subprocess

    code = "import sys\nfor line in sys.stdin: print(line.strip().upper(), flush=True)"
    with procs.Child(python(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        child.popen.stdin.write("hello\n")
        child.popen.stdin.flush()
        assert child.popen.stdout.readline() == "HELLO\n"
        child.popen.stdin.close()  # its "exit now"
        assert child.wait(DEADLINE_S) == 0
    assert child.popen.stdout.closed
