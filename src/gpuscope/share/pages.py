"""Pages of anonymous shared memory that no process, the creator included, can resize.

A file another user can truncate must never be mapped: touching a mapped page past a file's new end
kills the process with SIGBUS. So the ledger's pages are ``memfd``s sealed against shrinking and
growing, and tenants receive descriptors to them over the join socket, never a path.
"""

from __future__ import annotations

import fcntl
import os

PAGE = 4096
MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_page(name: str) -> int:
    """A descriptor of a new page, sealed: its size can never change."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, PAGE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def read_only(fd: int) -> int:
    """A second descriptor of ``fd``'s memory that can only read it: a tenant given this one can neither
    map the page writable nor write it."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)

