"""Helpers of the isolation tests: another local user, a folder like /dev/shm, joins from Python."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpuscope.share.joins import REPLY, hello
from gpuscope.share.ledger import LAYOUT_VERSION

NOBODY = 65534

#: What the other user runs to join: connect, send the hello given in hex, print the reply's status
#: and how many descriptors came with it. Plain Python, nothing of gpuscope: an attacker's own code.
JOIN_SCRIPT = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(bytes.fromhex(sys.argv[2]))
msg, fds, _, _ = socket.recv_fds(s, 1024, 4)
print(struct.unpack("<IIii", msg[:16])[1], len(fds))
"""


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def other_user_python() -> str:
    """A Python the other user can run (this test's may live under root's home), or skip."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("acting as another user needs root and setpriv (util-linux)")
    for candidate in ("/usr/bin/python3", sys.executable):
        if subprocess.run(as_nobody(candidate, "-c", "import socket; socket.recv_fds"),
                          capture_output=True).returncode == 0:
            return candidate
    pytest.skip("no Python that the user nobody may run")


@contextmanager
def shared_folder() -> Iterator[Path]:
    """A folder like /dev/shm: everyone may create names in it, sticky (only an owner removes a name)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix="gpuscope-test-", dir=base))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def join(prefix: str, tenant: str,
         version: int = LAYOUT_VERSION) -> tuple[socket.socket, int, list[int], str]:
    """Join as ``tenant`` from this process: the open connection, the reply's status, the descriptors
    it carried and its reason."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(prefix + ".sock")
    sock.send(hello(tenant, version))
    msg, fds, _, _ = socket.recv_fds(sock, 1024, 4)
    _, status, _, _, reason = REPLY.unpack(msg)
    return sock, status, fds, reason.split(b"\0", 1)[0].decode()
