"""The shared-memory ledger between the share controller and its tenants' preload library.

Three kinds of file, all under one path prefix (``/dev/shm/gpuscope-share`` by default):

- ``PREFIX``: the policy, created and written by the controller alone (mode 0644). Tenants map it
  read-only: the tenants' shares and priorities, the controller's pid and heartbeat, and the gate
  word (bit *i* set: tenant slot *i* may launch; bits 16..31 a generation) their launching threads
  sleep on with a futex (bitset 1; each process's helper thread sleeps on it too, with another bit,
  so that a hand-over can wake the launching threads alone), the beside mask (bit *i* set: slot *i*
  runs beside the slice holder, untimed), the busy mask (bit *i* set: slot *i* times each launch
  on its own, in a probe), per tenant the duty (the part of every 10 ms a tenant beside the holder
  may launch in, when it needs more of the GPU than its share) and, with draining hand-overs, when
  the holder's slice ends (the holder then stops launching by itself, drains its queue and rings the
  bell: one controller wake-up per hand-over instead of two).
- ``PREFIX.bell``: a world-writable page: the word the controller sleeps on, and a count of joins
  (it lists the slot files again when that moves). A tenant rings the bell when a thread
  starts waiting or a holder goes quiet. Writing it only wakes the controller early.
- ``PREFIX.p<PID>``: one per tenant process, created and written by that process alone (mode 0644):
  its counters (launches, GPU ns, throttled ns, hook errors) and the ``drained_gen`` word the
  controller waits on when it hands the GPU on.

A process therefore cannot raise its own share: the only shared state it can write is its own
counters and the bell. The layout is versioned (``LAYOUT_VERSION``); ``_preload.c`` mirrors every
offset below, and the tests read both sides.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

try:
    from gpuscope.share import _words as _native_words
except ImportError:  # no compiler where gpuscope was installed: ctypes serves (slower per wake-up)
    _native_words = None

POLICY_MAGIC = 0x48535347  # "GSSH"
PROC_MAGIC = 0x50535347  # "GSSP"
LAYOUT_VERSION = 5
MAX_TENANTS = 16
NAME_LEN = 40
PAGE = 4096
OPEN_MASK = 0xFFFF  # every slot may launch: no share binds

# policy_t
P_MAGIC, P_VERSION, P_PID, P_NTENANTS = 0, 4, 8, 12
P_HEARTBEAT, P_GATE, P_MODE = 16, 24, 28
P_WINDOW_US, P_INFLIGHT_SLICE, P_INFLIGHT_OPEN, P_STALE_MS = 32, 36, 40, 44
P_BUSY_MASK = 48  # slots in a probe: each launch timed on its own (busy time)
P_BESIDE_MASK = 52  # slots running beside the slice holder, their launches untimed
P_SLICE_END = 56  # draining hand-overs from the turn keeper: when the holder's slice ends (0: none)
P_TENANTS, TENANT_SIZE = 64, 64  # name[40], share_ppm, priority, active, duty_ppm
T_DUTY = NAME_LEN + 12  # in a tenant's entry: the part of each duty period it may launch in (0: all)

# proc_t
Q_MAGIC, Q_VERSION, Q_PID, Q_SLOT, Q_TENANT, Q_WAITING, Q_DRAINED = 0, 4, 8, 12, 16, 56, 60
PROC_COUNTERS = ("launches", "graph_launches", "hook_errors", "throttled_ns", "gpu_ns", "windows",
                 "last_launch_ns", "inflight", "failed_open", "started_ns", "waits", "window_open",
                 "busy_launches", "busy_ns")
Q_COUNTERS = 64
#: Where the words the controller's turn keeper reads (in C) lie in a process's page: whether it wants
#: the GPU (threads held at the gate, a window open, windows in flight, its last launch) and the
#: generation its queued work was drained under.
KEEPER_OFFSETS = (Q_WAITING, *(Q_COUNTERS + 8 * PROC_COUNTERS.index(name)
                                for name in ("window_open", "inflight", "last_launch_ns")), Q_DRAINED)

MODES = {"events": 0, "nvml": 1}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1
SYS_FUTEX = 202  # x86-64; the preload library is built for the same machine
FUTEX_WAIT, FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class CtypesWords:
    """What the ``_words`` extension does, through ctypes (where it was not built)."""

    @staticmethod
    def u32(addr: int) -> int:
        return ctypes.c_uint32.from_address(addr).value

    @staticmethod
    def u64(addr: int) -> int:
        return ctypes.c_uint64.from_address(addr).value

    @staticmethod
    def set_u32(addr: int, value: int) -> None:
        ctypes.c_uint32.from_address(addr).value = value

    @staticmethod
    def set_u64(addr: int, value: int) -> None:
        ctypes.c_uint64.from_address(addr).value = value

    @staticmethod
    def futex_wait(addr: int, expected: int, timeout_s: float) -> bool:
        ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        rc = _libc.syscall(SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAIT, ctypes.c_uint32(expected),
                           ctypes.byref(ts), None, 0)
        return not (rc != 0 and ctypes.get_errno() == errno.ETIMEDOUT)

    @staticmethod
    def futex_wake(addr: int) -> None:
        _libc.syscall(SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


#: The shared words' reads, writes and futex calls: the C extension, or ctypes.
_words = _native_words if _native_words is not None else CtypesWords


class Mapping:
    """A page of a file mapped with libc's mmap, so futex calls get a stable address (Python's mmap
    module does not expose one for read-only mappings)."""

    def __init__(self, path: str, *, writable: bool) -> None:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < PAGE:  # touching a page past the file's end would be a SIGBUS
                raise ValueError(f"{path} is shorter than a ledger page")
            prot = PROT_READ | (PROT_WRITE if writable else 0)
            addr = _libc.mmap(None, PAGE, prot, MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        self.addr: int = addr
        self.path = path

    def u32(self, off: int) -> int:
        return _words.u32(self.addr + off)

    def i32(self, off: int) -> int:
        return ctypes.c_int32.from_address(self.addr + off).value

    def u64(self, off: int) -> int:
        return _words.u64(self.addr + off)

    def set_u32(self, off: int, value: int) -> None:
        _words.set_u32(self.addr + off, value)

    def set_u64(self, off: int, value: int) -> None:
        _words.set_u64(self.addr + off, value)

    def text(self, off: int, size: int) -> str:
        return ctypes.string_at(self.addr + off, size).split(b"\0", 1)[0].decode(errors="replace")

    def futex_wait(self, off: int, expected: int, timeout_s: float) -> bool:
        """Sleep while the word at ``off`` equals ``expected``, at most ``timeout_s``; False on timeout."""
        return _words.futex_wait(self.addr + off, expected, float(timeout_s))

    def futex_wake(self, off: int) -> None:
        _words.futex_wake(self.addr + off)

    def close(self) -> None:
        if self.addr:
            _libc.munmap(self.addr, PAGE)
            self.addr = 0


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's entry in the policy: its name, target share of GPU time and priority."""

    name: str
    share: float
    priority: int = 0


def _create(path: str, mode: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.ftruncate(fd, PAGE)
        os.fchmod(fd, mode)  # the umask must not narrow it
    finally:
        os.close(fd)


class Policy:
    """The controller's side of the ledger: creates the policy and bell files, writes the gate."""

    def __init__(self, prefix: str, tenants: Sequence[TenantPolicy], *, mode: str = "events",
                 window_us: int = 2000, inflight_slice: int = 2, inflight_open: int = 16,
                 stale_ms: int = 2000) -> None:
        if not 1 <= len(tenants) <= MAX_TENANTS:
            raise ValueError(f"between 1 and {MAX_TENANTS} tenants, not {len(tenants)}")
        self.prefix = prefix
        self.tenants = list(tenants)
        self.window_us = window_us
        _create(prefix + ".bell", 0o666)
        self.bell = Mapping(prefix + ".bell", writable=True)
        tmp = f"{prefix}.tmp{os.getpid()}"
        _create(tmp, 0o644)
        self.map = Mapping(tmp, writable=True)
        m = self.map
        m.set_u32(P_VERSION, LAYOUT_VERSION)
        ctypes.c_int32.from_address(m.addr + P_PID).value = os.getpid()
        m.set_u32(P_NTENANTS, len(tenants))
        m.set_u32(P_MODE, MODES[mode])
        for off, value in ((P_WINDOW_US, window_us), (P_INFLIGHT_SLICE, inflight_slice),
                           (P_INFLIGHT_OPEN, inflight_open), (P_STALE_MS, stale_ms)):
            m.set_u32(off, value)
        for i, t in enumerate(tenants):
            base = P_TENANTS + i * TENANT_SIZE
            name = t.name.encode()
            if not name or len(name) >= NAME_LEN:
                raise ValueError(f"tenant name {t.name!r} must be 1 to {NAME_LEN - 1} bytes")
            ctypes.memmove(m.addr + base, name, len(name))
            m.set_u32(base + NAME_LEN, round(t.share * 1e6))
            m.set_u32(base + NAME_LEN + 4, t.priority)
            m.set_u32(base + NAME_LEN + 8, 1)
        self.gen = 1
        m.set_u32(P_GATE, (self.gen << 16) | OPEN_MASK)
        self.heartbeat()
        m.set_u32(P_MAGIC, POLICY_MAGIC)
        os.replace(tmp, prefix)  # tenants never see a half-written policy
        self.map.path = prefix

    def heartbeat(self) -> None:
        self.map.set_u64(P_HEARTBEAT, time.monotonic_ns())  # CLOCK_MONOTONIC, as the library reads it

    @property
    def gate(self) -> int:
        return self.map.u32(P_GATE)

    @property
    def gate_address(self) -> int:
        return self.map.addr + P_GATE

    @property
    def heartbeat_address(self) -> int:
        return self.map.addr + P_HEARTBEAT

    @property
    def bell_address(self) -> int:
        return self.bell.addr

    def set_gate(self, mask: int) -> int:
        """Let the slots in ``mask`` launch (``OPEN_MASK``: all); returns the new generation."""
        self.gen = (self.gen + 1) & 0xFFFF or 1
        self.map.set_u32(P_GATE, (self.gen << 16) | (mask & 0xFFFF))
        self.map.futex_wake(P_GATE)
        return self.gen

    @property
    def slice_end_address(self) -> int:
        return self.map.addr + P_SLICE_END

    @property
    def slice_end_ns(self) -> int:
        return self.map.u64(P_SLICE_END)

    @property
    def busy_mask(self) -> int:
        return self.map.u32(P_BUSY_MASK)

    def set_busy_mask(self, mask: int) -> None:
        """Have the slots in ``mask`` time each launch on its own (a probe of their busy time)."""
        self.map.set_u32(P_BUSY_MASK, mask & 0xFFFF)

    @property
    def beside_mask(self) -> int:
        return self.map.u32(P_BESIDE_MASK)

    def set_beside_mask(self, mask: int) -> None:
        """Mark the slots in ``mask`` as running beside the holder: untimed, never drained at a
        hand-over."""
        self.map.set_u32(P_BESIDE_MASK, mask & 0xFFFF)

    def duty(self, slot: int) -> float:
        ppm = self.map.u32(P_TENANTS + slot * TENANT_SIZE + T_DUTY)
        return 1.0 if ppm == 0 else ppm / 1e6

    def set_duty(self, slot: int, fraction: float) -> None:
        """Let tenant ``slot``, beside the holder, launch only in the first ``fraction`` of every duty
        period (1: always)."""
        ppm = 0 if fraction >= 1 else max(1, round(max(0.0, fraction) * 1e6))
        self.map.set_u32(P_TENANTS + slot * TENANT_SIZE + T_DUTY, ppm)

    def bell_value(self) -> int:
        return self.bell.u32(0)

    def joins(self) -> int:
        """How many tenant processes have joined (a hint to list the slot files, not a count to trust)."""
        return self.bell.u32(4)

    def wait_bell(self, seen: int, timeout_s: float) -> None:
        """Sleep until a tenant rings (the bell's word moves past ``seen``) or ``timeout_s`` passes."""
        if timeout_s > 0:
            self.bell.futex_wait(0, seen, timeout_s)

    def close(self, *, remove: bool = True) -> None:
        if remove:
            for path in (self.prefix, self.prefix + ".bell"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self.map.close()
        self.bell.close()


class ProcView:
    """A tenant process's counters, mapped read-only by the controller."""

    def __init__(self, path: str) -> None:
        self.map = Mapping(path, writable=False)
        self.path = path
        if self.map.u32(Q_MAGIC) != PROC_MAGIC or self.map.u32(Q_VERSION) != LAYOUT_VERSION:
            self.map.close()
            raise ValueError(f"{path} is not a version-{LAYOUT_VERSION} tenant slot")
        self.pid = self.map.i32(Q_PID)
        self.slot = self.map.i32(Q_SLOT)
        self.tenant = self.map.text(Q_TENANT, NAME_LEN)
        self._offsets = {name: Q_COUNTERS + 8 * i for i, name in enumerate(PROC_COUNTERS)}

    @property
    def address(self) -> int:
        """Where its page is mapped (``KEEPER_OFFSETS`` lie inside it)."""
        return self.map.addr

    def counter(self, name: str) -> int:
        return self.map.u64(self._offsets[name])

    def counters(self) -> dict[str, int]:
        raw = ctypes.string_at(self.map.addr + Q_COUNTERS, 8 * len(PROC_COUNTERS))
        return dict(zip(PROC_COUNTERS, struct.unpack(f"<{len(PROC_COUNTERS)}Q", raw), strict=True))

    @property
    def waiting(self) -> int:
        return self.map.u32(Q_WAITING)

    @property
    def drained_gen(self) -> int:
        return self.map.u32(Q_DRAINED)

    def wait_drained(self, gen: int, timeout_s: float, tick: Callable[[], None] | None = None) -> bool:
        """Sleep until the process says it has nothing queued under generation ``gen`` (``tick``: called
        every 50 ms of the wait, for the controller's heartbeat)."""
        deadline = time.monotonic_ns() + int(timeout_s * 1e9)
        while True:
            if tick is not None:
                tick()
            seen = self.drained_gen
            if seen == gen:
                return True
            left = (deadline - time.monotonic_ns()) / 1e9
            if left <= 0:
                return False
            if not self.map.futex_wait(Q_DRAINED, seen, min(left, 0.05)) and not pid_alive(self.pid):
                return False  # a process that died with work queued never posts its drain

    def close(self) -> None:
        self.map.close()


def pid_alive(pid: int, *, zombie_check: bool = True) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not; telling
    one costs a read of /proc, which ``zombie_check=False`` skips)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if not zombie_check:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs to ask: kill() said it exists
    return state not in ("Z", "X")


def proc_paths(prefix: str) -> dict[int, str]:
    """pid -> path of every tenant slot file next to the policy."""
    folder, base = os.path.split(prefix)
    out: dict[int, str] = {}
    try:
        names = os.listdir(folder or ".")
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith(base + ".p") and name[len(base) + 2:].isdigit():
            out[int(name[len(base) + 2:])] = os.path.join(folder, name)
    return out
