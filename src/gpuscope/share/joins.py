"""The join socket: how a tenant process proves who it is and receives its pages of the ledger.

A process that loads the preload library with ``GPUSCOPE_SHARE_TENANT`` set connects to
``PREFIX.sock`` (a ``SOCK_SEQPACKET`` Unix socket) and sends one hello (``HELLO``: magic, layout
version, tenant name, the UUID of the device it joins for: a process that uses two GPUs joins once for
each). One controller holds every GPU of a node, a ledger each (``Device``): the hello goes to its
device's ledger; a controller of one GPU also takes a hello whose UUID the driver could not tell, and
one whose GPU it cannot name (no NVML). The controller takes the process's pid, uid and gid from the kernel
(``SO_PEERCRED``: the process cannot lie about them), checks the name against the policy and the
admission rules (``access.py``), and answers (``REPLY``: magic, status, slot, pid, reason). Admitted,
the answer carries four descriptors (``SCM_RIGHTS``): the policy (read-only), the bell, a fresh page
of the process's own, and its tenant's memory page, all sealed against resizing (``pages.py``).

The connection stays open while the process lives: its end (the process exited, or was killed) tells
the controller at once, and a controller that restarts is told by its tenants connecting again.

A connection must send its hello within ``HELLO_TIMEOUT_S``; at most ``MAX_PENDING`` wait to do so
(beyond, the oldest is closed), so that local users opening connections cannot stall joins for
long. Every outcome is counted (``results``), for ``gpuscope_share_joins_total{result}``.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuscope.share.access import Access, Peer

HELLO_MAGIC = 0x4A535347  # "GSSJ"
REPLY_MAGIC = 0x41535347  # "GSSA"
NAME_LEN = 40
UUID_LEN = 16
HELLO = struct.Struct(f"<II{NAME_LEN}s{UUID_LEN}s")
REASON_LEN = 120
REPLY = struct.Struct(f"<IIii{REASON_LEN}s")
_PEERCRED = struct.Struct("3i")

#: Reply statuses (the preload library says the reason, and runs unthrottled, on anything but OK).
OK, UNKNOWN_TENANT, NOT_ALLOWED, BAD_HELLO, FULL, OTHER_GPU = 0, 1, 2, 3, 4, 5
#: The outcomes counted per result label.
RESULTS = ("joined", "unknown_tenant", "not_allowed", "bad_hello", "timeout", "full", "left", "other_gpu")

HELLO_TIMEOUT_S = 1.0
MAX_PENDING = 64
MAX_PROCESSES = 512


@dataclass(frozen=True)
class JoinEvent:
    """A process that joined (``page``: what ``make_page`` returned for it) or left."""

    kind: str  # "join" or "leave"
    pid: int
    slot: int = -1
    tenant: str = ""
    page: Any = None


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    since: float
    pid: int = 0  # once joined
    device: Device | None = None  # once joined


@dataclass(eq=False)
class Device:
    """One GPU's ledger as the join server sees it: who may join it and what a joining process gets.

    ``make_page(pid, slot, tenant)`` returns ``(fd, page)``: a sealed page with the process's header
    written, and the object the controller keeps for it; ``shared_fds(slot)`` the policy (read-only),
    the bell and the tenant's memory page; ``ring`` wakes that GPU's controller after each event."""

    uuid: bytes  # the 16 bytes of the GPU's UUID (b"": unknown, no NVML)
    tenants: list[str | None]
    access: Access
    shared_fds: Callable[[int], tuple[int, int, int]]
    make_page: Callable[[int, int, str], tuple[int, Any]]
    ring: Callable[[], None]
    events: list[JoinEvent] = field(default_factory=list)


def format_uuid(uuid: bytes) -> str:
    """A UUID as NVML writes it (``GPU-xxxxxxxx-xxxx-...``); ``unknown`` for none."""
    if not any(uuid):
        return "unknown"
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def parse_uuid(text: str) -> bytes:
    """NVML's ``GPU-xxxxxxxx-...`` (or MIG's ``MIG-``) as the 16 bytes the driver gives a process."""
    h = text.split("-", 1)[1] if text[:4] in ("GPU-", "MIG-") else text
    raw = bytes.fromhex(h.replace("-", ""))
    if len(raw) != UUID_LEN:
        raise ValueError(f"not a GPU UUID: {text}")
    return raw


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return Peer(pid, uid, gid)


def hello(tenant: str, layout_version: int, uuid: bytes = b"") -> bytes:
    """A hello as the preload library sends it (tests use it to join from Python): ``uuid`` the 16
    bytes of the device's UUID (none: unknown)."""
    return HELLO.pack(HELLO_MAGIC, layout_version, tenant.encode()[:NAME_LEN - 1], uuid)


class JoinServer:
    """Admits tenant processes on a listening socket, in a thread of its own, to the ledgers of the
    GPUs it serves (``add``)."""

    def __init__(self, sock: socket.socket, *, layout_version: int, hello_timeout_s: float = HELLO_TIMEOUT_S,
                 max_pending: int = MAX_PENDING, max_processes: int = MAX_PROCESSES,
                 log: Callable[[str], None] | None = None) -> None:
        self.sock = sock
        self.devices: list[Device] = []
        self.layout_version = layout_version
        self.hello_timeout_s = hello_timeout_s
        self.max_pending = max_pending
        self.max_processes = max_processes
        self.results = dict.fromkeys(RESULTS, 0)
        self.log = log
        self._logged: set[tuple[str, int, str]] = set()  # (result, uid, tenant) refusals already logged
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, _Conn] = {}
        self._joined: dict[socket.socket, _Conn] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gpuscope-share-joins", daemon=True)

    def start(self) -> None:
        self.sock.setblocking(False)
        self._selector.register(self.sock, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(5)
        for conn in [*self._pending.values(), *self._joined.values()]:
            conn.sock.close()
        self._pending.clear()
        self._joined.clear()
        self._selector.close()
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def add(self, device: Device) -> None:
        """Serve ``device``'s ledger too (before start)."""
        self.devices.append(device)

    @staticmethod
    def set_tenants(device: Device, tenants: Sequence[str | None], access: Access | None = None) -> None:
        """A new policy's names, slot for slot (None: removed), and its admission rules."""
        device.tenants = list(tenants)  # one assignment each: the join thread sees the old or the new
        if access is not None:
            device.access = access

    def take(self, device: Device) -> list[JoinEvent]:
        with self._lock:
            events, device.events = device.events, []
        return events

    def _emit(self, device: Device, event: JoinEvent) -> None:
        with self._lock:
            device.events.append(event)
        device.ring()

    def route(self, uuid: bytes) -> Device | None:
        """The ledger a hello for the GPU ``uuid`` joins: the GPU's own; a controller of one GPU also
        takes a hello without a UUID (the driver could not tell it), and any hello when it cannot
        name its GPU itself."""
        for device in self.devices:
            if device.uuid and device.uuid == uuid:
                return device
        if len(self.devices) == 1 and (not self.devices[0].uuid or not any(uuid)):
            return self.devices[0]
        return None

    def _count(self, result: str) -> None:
        with self._lock:
            self.results[result] += 1

    # --- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            timeout = None
            if self._pending:
                oldest = min(c.since for c in self._pending.values())
                timeout = max(0.0, oldest + self.hello_timeout_s - now)
            for key, _ in self._selector.select(timeout):
                try:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        return
                    elif key.data == "pending":
                        self._hello(key.fileobj)
                    else:
                        self._watch(key.fileobj)
                except Exception:  # one bad connection never stops the joins of the others
                    with contextlib.suppress(Exception):
                        self._drop(key.fileobj)
            now = time.monotonic()
            for conn in [c for c in self._pending.values() if now - c.since >= self.hello_timeout_s]:
                self._count("timeout")
                self._drop(conn.sock)

    def _accept(self) -> None:
        for _ in range(64):  # a burst, then the others get their turn
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, say: the connection stays in the backlog
                return
            if len(self._pending) >= self.max_pending:
                oldest = min(self._pending.values(), key=lambda c: c.since)
                self._count("timeout")
                self._drop(oldest.sock)
            sock.setblocking(False)
            self._pending[sock] = _Conn(sock, time.monotonic())
            self._selector.register(sock, selectors.EVENT_READ, "pending")

    def _drop(self, sock: Any) -> None:
        self._pending.pop(sock, None)
        conn = self._joined.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()
        if conn is not None and conn.device is not None:
            self._count("left")
            self._emit(conn.device, JoinEvent("leave", conn.pid))

    def _refuse(self, sock: socket.socket, status: int, result: str, reason: str, peer: Peer | None = None,
                tenant: str = "") -> None:
        self._count(result)
        key = (result, peer.uid if peer else -1, tenant)
        if self.log is not None and key not in self._logged and len(self._logged) < 256:
            self._logged.add(key)  # once per kind of refusal: a loop of attempts is counted, not logged
            self.log(f"gpuscope share: refused a join: {reason}")
        with contextlib.suppress(OSError):
            sock.send(REPLY.pack(REPLY_MAGIC, status, -1, 0, reason.encode()[:REASON_LEN - 1]))
        self._close_pending(sock)

    @staticmethod
    def _read(sock: socket.socket) -> bytes | None:
        """What a connection sent (b"" once it ended; None when nothing is there after all)."""
        try:
            return sock.recv(256)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _close_pending(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def _hello(self, sock: socket.socket) -> None:
        data = self._read(sock)
        if data is None:
            return
        if not data:
            self._close_pending(sock)
            return
        if len(data) != HELLO.size:
            self._refuse(sock, BAD_HELLO, "bad_hello", f"a hello is {HELLO.size} bytes, not {len(data)}")
            return
        magic, version, raw_name, uuid = HELLO.unpack(data)
        if magic != HELLO_MAGIC or version != self.layout_version:
            self._refuse(sock, BAD_HELLO, "bad_hello",
                         f"not a version-{self.layout_version} hello (a preload library of another release?)")
            return
        name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        peer = peer_of(sock)
        if peer.pid <= 0:
            self._refuse(sock, NOT_ALLOWED, "not_allowed",
                         "the process is in a pid namespace the controller cannot see")
            return
        device = self.route(uuid)
        if device is None:
            self._refuse(sock, OTHER_GPU, "other_gpu", f"GPU {format_uuid(uuid)} is not one this controller "
                         "holds (--share.gpus)", peer, name)
            return
        tenants, access = device.tenants, device.access
        if not name or name not in tenants:
            self._refuse(sock, UNKNOWN_TENANT, "unknown_tenant", f"the controller has no share named {name}",
                         peer, name)
            return
        if not access.admits(name, peer):
            self._refuse(sock, NOT_ALLOWED, "not_allowed",
                         f"pid {peer.pid} (uid {peer.uid}, gid {peer.gid}) may not join as {name} "
                         f"(--share.allow {name}={access.describe(name)})", peer, name)
            return
        if len(self._joined) >= self.max_processes:
            self._refuse(sock, FULL, "full", f"the controller holds {self.max_processes} processes already",
                         peer, name)
            return
        slot = tenants.index(name)
        fd, page = device.make_page(peer.pid, slot, name)
        try:
            sock.setblocking(True)
            sock.settimeout(self.hello_timeout_s)
            policy_fd, bell_fd, tenant_fd = device.shared_fds(slot)
            socket.send_fds(sock, [REPLY.pack(REPLY_MAGIC, OK, slot, peer.pid, b"")],
                            [policy_fd, bell_fd, fd, tenant_fd])
            sock.setblocking(False)
        except OSError:
            page.close()
            self._close_pending(sock)
            return
        finally:
            os.close(fd)
        self._pending.pop(sock, None)
        self._joined[sock] = _Conn(sock, time.monotonic(), peer.pid, device)
        self._selector.modify(sock, selectors.EVENT_READ, "joined")
        self._count("joined")
        self._emit(device, JoinEvent("join", peer.pid, slot, name, page))

    def _watch(self, sock: socket.socket) -> None:
        """A joined process's connection: readable only when it ends (the process sends nothing more)."""
        if self._read(sock) == b"":
            self._drop(sock)
