"""The two names the share controller keeps on the filesystem, made safe against other local users.

Everything the controller and its tenants share in memory is an anonymous, sealed ``memfd`` handed
over a Unix socket (``pages.py``, ``joins.py``): nothing in ``/dev/shm`` can be truncated, replaced
or forged by another user. What remains on the filesystem, under the ``--share.ledger`` prefix:

- ``PREFIX.lock``: the controller's exclusive lock (``flock``), so that a second controller on the
  same ledger refuses to start with one line instead of taking the first one's tenants;
- ``PREFIX.sock``: the socket tenants join through (a connection proves its pid, uid and gid to the
  kernel, which tells the controller: ``SO_PEERCRED``).

Both live in a folder like ``/dev/shm``, where any user may create names. So: the folder is checked
before anything is created (an existing folder, not writable by others unless sticky); the lock is
opened with ``O_NOFOLLOW`` (created with ``O_EXCL`` where new) and must be a plain file owned by the
controller's user; a socket path that exists is removed only when it is a socket owned by that user
(a stale one of its own, and the lock says no controller uses it), and refused otherwise. Nothing is
created when a check fails, and nothing is trusted that another user could have put there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat

#: sun_path holds 108 bytes, the terminating zero included.
MAX_SOCKET_PATH = 107


class LedgerError(Exception):
    """The ledger cannot be set up at this prefix; the message says why, in one line."""


def lock_path(prefix: str) -> str:
    return prefix + ".lock"


def socket_path(prefix: str) -> str:
    return prefix + ".sock"


def check_prefix(prefix: str) -> None:
    """Raise LedgerError unless ``prefix`` names files in a folder safe to create them in. Creates nothing."""
    if not prefix or prefix.endswith("/"):
        raise LedgerError(f"--share.ledger {prefix!r} must be a path prefix such as /dev/shm/gpuscope-share, "
                          "not a folder")
    if len(os.fsencode(socket_path(prefix))) > MAX_SOCKET_PATH:
        raise LedgerError(f"--share.ledger {prefix!r} is too long for a Unix socket path "
                          f"({MAX_SOCKET_PATH - len('.sock')} bytes at most)")
    folder = os.path.dirname(os.path.abspath(prefix))
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise LedgerError(f"--share.ledger {prefix!r}: folder {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LedgerError(f"--share.ledger {prefix!r}: {folder} is not a folder")
    if st.st_uid not in (0, os.geteuid()):
        raise LedgerError(f"--share.ledger {prefix!r}: {folder} belongs to uid {st.st_uid}, who could "
                          "replace the controller's files: use /dev/shm or a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise LedgerError(f"--share.ledger {prefix!r}: {folder} is writable by other users and not sticky "
                          "(they could replace the controller's files): use /dev/shm or a folder of your own")
    if os.path.isdir(prefix):
        raise LedgerError(f"--share.ledger {prefix!r} is a folder: give a path prefix inside it, such as "
                          f"{os.path.join(prefix, 'gpuscope-share')}")


def _open_lock(path: str) -> int:
    """Open (creating exclusively where new) the lock file, refusing one this user did not create."""
    # O_NONBLOCK: a FIFO planted at the name cannot hang the open
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LedgerError(f"{path} is a symbolic link: refusing it (remove it; someone may be "
                              "trying to redirect the controller's files)") from None
        raise LedgerError(f"cannot open {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a plain file"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not this controller's user ({os.geteuid()})"
    elif st.st_mode & 0o022 or st.st_nlink != 1:
        problem = "is writable by others or has other names (hard links)"
    if problem:
        os.close(fd)
        raise LedgerError(f"{path} {problem}: refusing it (this controller did not create it; remove it)")
    return fd


class LedgerLock:
    """``PREFIX.lock``, held with ``flock`` while the controller runs (released by the kernel if it dies)."""

    def __init__(self, prefix: str) -> None:
        self.path = lock_path(prefix)
        for _ in range(3):  # the file may be removed by the previous holder between our open and lock
            fd = _open_lock(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise LedgerError(f"another gpuscope share (pid {holder}) holds the ledger {prefix}: "
                                  "one controller per ledger") from None
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return
            os.close(fd)
        raise LedgerError(f"{self.path} keeps changing under the controller: refusing to start")

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no other controller holds a removed one)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino:
                    os.unlink(self.path)
            os.close(self.fd)
            self.fd = -1


def listen_socket(prefix: str, backlog: int = 128) -> tuple[socket.socket, int]:
    """Bind ``PREFIX.sock`` (call with the lock held) for tenants of every user to connect to; returns
    the listening socket and its inode (to remove it later only if it is still this one)."""
    path = socket_path(prefix)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise LedgerError(f"{path} exists and is not this user's socket: refusing it (remove it; "
                              "someone may be squatting the controller's name)")
        os.unlink(path)  # a stale socket of a controller of this user that died: the lock is ours now
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0)  # anyone may connect: who joins as which tenant is decided from its credentials
    try:
        sock.bind(path)  # never follows or replaces an existing name: EADDRINUSE
    except OSError as exc:
        sock.close()
        raise LedgerError(f"cannot create {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    sock.listen(backlog)
    return sock, os.lstat(path).st_ino


def remove_socket(prefix: str, inode: int) -> None:
    """Remove ``PREFIX.sock`` if it is still the one this controller created."""
    path = socket_path(prefix)
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
