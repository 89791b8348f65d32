"""The shared-memory ledger between the share controller and its tenants' preload library.

Three kinds of page, each an anonymous ``memfd`` the controller creates and seals against resizing
(``F_SEAL_SHRINK | F_SEAL_GROW``: nobody can truncate a page under a process that maps it, which
would kill that process with SIGBUS), handed to each tenant process over the join socket
(``joins.py``; the filesystem holds only that socket and a lock: ``files.py``):

- the policy, written by the controller alone; tenants get a read-only descriptor: the tenants'
  shares and priorities, the controller's pid and heartbeat, and the gate word (bit *i* set: tenant
  slot *i* may launch; bits 16..31 a generation) their launching threads sleep on with a futex
  (bitset 1; each process's helper thread sleeps on it too, with another bit, so that a hand-over can
  wake the launching threads alone), the beside mask (bit *i* set: slot *i* runs beside the slice
  holder, untimed), the turns mask (bit *i* set: slot *i* takes turns; a holder alone in it has
  nobody waiting for its hand-over, and its helper posts in batches), the busy mask (bit *i* set:
  slot *i* times each launch on its own, in a probe), per tenant the duty (the part of every 10 ms
  a tenant beside the holder may launch in, when it needs more of the GPU than its share; or the lone
  holder, with ``--share.lone-holder duty``) and, with draining hand-overs, when the holder's slice
  ends (the holder then stops launching by itself, drains its queue and rings the bell: one
  controller wake-up per hand-over instead of two).
- the bell, a page every joined tenant may write: the word the controller sleeps on. A tenant rings
  it when a thread starts waiting or a holder goes quiet. Writing it only wakes the controller early.
- one page per tenant process, written by that process: its counters (launches, GPU ns, throttled
  ns, hook errors) and the ``drained_gen`` word the controller waits on when it hands the GPU on. The
  controller writes the process's pid, slot and tenant there before handing it over, and keeps its
  own copy of them: what the process writes on its page never changes who it is.

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

from gpuscope.share.access import Access
from gpuscope.share.files import LedgerLock, check_prefix, listen_socket, remove_socket
from gpuscope.share.joins import Device, JoinEvent, JoinServer
from gpuscope.share.pages import PAGE, read_only, sealed_page

try:
    from gpuscope.share import _words as _native_words
except ImportError:  # no compiler where gpuscope was installed: ctypes serves (slower per wake-up)
    _native_words = None

POLICY_MAGIC = 0x48535347  # "GSSH"
PROC_MAGIC = 0x50535347  # "GSSP"
LAYOUT_VERSION = 14
MAX_TENANTS = 16
NAME_LEN = 40
OPEN_MASK = 0xFFFF  # every slot may launch: no share binds

# policy_t (every offset here is checked against _ledger.h by tests/share/test_layout.py)
P_MAGIC, P_VERSION, P_PID, P_NTENANTS = 0, 4, 8, 12
P_HEARTBEAT, P_GATE, P_MODE = 16, 24, 28
P_WINDOW_US, P_INFLIGHT_SLICE, P_INFLIGHT_OPEN, P_STALE_MS = 32, 36, 40, 44
P_BUSY_MASK = 48  # slots in a probe: each launch timed on its own (busy time)
P_BESIDE_MASK = 52  # slots running beside the slice holder, their launches untimed
P_SLICE_END = 56  # draining hand-overs from the turn keeper: when the holder's slice ends (0: none)
P_LENDER_MASK = 64  # slots that lent the rest of their turn: their first held thread rings the bell
P_BESIDE_QUEUE_US = 68  # GPU time (µs) a slice holder queues while a tenant runs beside it
P_TURNS_MASK = 72  # slots taking turns (active, not beside): a holder alone among them is not watched
P_HOLD_MASK = 76  # the turn keeper's: the holder waits out a burst of a tenant of higher priority
P_PRIORITY_HOLD = 80  # 1: tenants of higher priority beside the holder post their bursts
P_TENANTS, TENANT_SIZE = 128, 64  # name[40], share_ppm, priority, active, duty_ppm, mem_cap
T_SHARE, T_PRIORITY, T_ACTIVE = NAME_LEN, NAME_LEN + 4, NAME_LEN + 8  # in a tenant's entry
T_DUTY = NAME_LEN + 12  # in a tenant's entry: the part of each duty period it may launch in (0: all)
T_MEM_CAP = NAME_LEN + 16  # its memory cap: bytes, or MEM_CAP_FRACTION | parts per million of the card
MEM_CAP_FRACTION = 1 << 63

# tenant_mem_t: one page per tenant, written by all its processes
TENANT_MAGIC = 0x54535347  # "GSST"
M_MAGIC, M_VERSION, M_USED, M_REFUSED, M_PEAK, M_CARD = 0, 4, 8, 16, 24, 32

#: What a process's helper thread slept on before each wake-up (``proc_t``'s ``helper_wakes_*``, in
#: order): a probe's batch posting, the window lock a launching thread held, a window's end event, a
#: drain's event; and on the gate word a nap while the launching thread posts its windows, a watch for
#: a quiet holder and a plain sleep, each woken (by a gate write or its own launching thread) or run out
#: (``_timeout``).
HELPER_WAKE_REASONS = ("probe", "lock", "window", "drain", "nap", "nap_timeout", "watch", "watch_timeout",
                       "gate", "gate_timeout")

# proc_t
Q_MAGIC, Q_VERSION, Q_PID, Q_SLOT, Q_TENANT, Q_WAITING, Q_DRAINED = 0, 4, 8, 12, 16, 56, 60
PROC_COUNTERS = ("launches", "graph_launches", "hook_errors", "throttled_ns", "gpu_ns", "windows",
                 "last_launch_ns", "inflight", "failed_open", "started_ns", "waits", "window_open",
                 "busy_launches", "busy_ns", "mem_bytes", "mem_refused", "sync_wait_ns", "sync_open",
                 "sync_open_since_ns", *(f"helper_wakes_{r}" for r in HELPER_WAKE_REASONS), "helper_cpu_ns",
                 "burst_ns")
Q_COUNTERS = 64
#: Where the words the controller's turn keeper reads (in C) lie in a process's page: whether it wants
#: the GPU (threads held at the gate, a window open, windows in flight, its last launch), the
#: generation its queued work was drained under, and when its burst of launches began (a tenant of
#: higher priority beside the holder, with priority holds on).
KEEPER_OFFSETS = (Q_WAITING, *(Q_COUNTERS + 8 * PROC_COUNTERS.index(name)
                                for name in ("window_open", "inflight", "last_launch_ns")), Q_DRAINED,
                  Q_COUNTERS + 8 * PROC_COUNTERS.index("burst_ns"))

#: A slice holder with nothing queued and no launch for this long is quiet: it lends the rest of its
#: turn (``_wake_bits.h`` QUIET_NS, which the preload library and the turn keeper use; equal by test).
QUIET_NS = 300_000

#: The accounting window's GPU time and how many windows a slice holder may queue
#: (``--share.window``, ``--share.queued-windows``: the settings take their defaults from here).
DEFAULT_WINDOW_US, DEFAULT_QUEUED_WINDOWS, DEFAULT_INFLIGHT_OPEN, DEFAULT_STALE_MS = 2000, 2, 16, 2000
#: The GPU time a slice holder keeps queued while a tenant of higher priority runs beside it
#: (``--share.beside-queue``; 0: its usual queue)
DEFAULT_BESIDE_QUEUE_US = 500

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
    def sub_u64_floor(addr: int, value: int) -> None:
        # not atomic: the C extension is (this path serves only where nothing was compiled, and then
        # no tenant runs the preload library either)
        word = ctypes.c_uint64.from_address(addr)
        word.value = max(0, word.value - value)

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
    """A page mapped with libc's mmap from a descriptor, so futex calls get a stable address (Python's
    mmap module does not expose one for read-only mappings)."""

    def __init__(self, fd: int, *, writable: bool, name: str = "ledger page") -> None:
        if os.fstat(fd).st_size < PAGE:  # touching a page past the file's end would be a SIGBUS
            raise ValueError(f"{name} is shorter than a ledger page")
        prot = PROT_READ | (PROT_WRITE if writable else 0)
        addr = _libc.mmap(None, PAGE, prot, MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {name}")
        self.addr: int = addr
        self.name = name

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
    """One tenant's entry in the policy: its name, target share of GPU time, priority and memory cap
    (``memory``: bytes if at least 1, a fraction of the card if below; 0: none). A ``gang`` tenant's
    processes are one group across the node's GPUs (the ranks of a job that runs collectives): its
    turns are granted on all its GPUs at once (``gangs.py``). The controller's alone: not in the page."""

    name: str
    share: float
    priority: int = 0
    memory: float = 0
    gang: bool = False

    def mem_cap_word(self) -> int:
        """The cap as the policy page holds it."""
        if self.memory <= 0:
            return 0
        if self.memory < 1 or (isinstance(self.memory, float) and self.memory == 1.0):
            return MEM_CAP_FRACTION | round(self.memory * 1e6)
        return int(self.memory)


class TenantMemory:
    """A tenant's memory page: what its processes hold together, reserved before each allocation."""

    def __init__(self, fd: int, name: str) -> None:
        self.map = Mapping(fd, writable=True, name=f"the memory page of tenant {name}")
        self.map.set_u32(M_VERSION, LAYOUT_VERSION)
        self.map.set_u32(M_MAGIC, TENANT_MAGIC)

    @property
    def used(self) -> int:
        return self.map.u64(M_USED)

    @property
    def refused(self) -> int:
        return self.map.u64(M_REFUSED)

    @property
    def peak(self) -> int:
        return self.map.u64(M_PEAK)

    @property
    def card_bytes(self) -> int:
        """The card's size as a tenant process saw it (0 until one asked)."""
        return self.map.u64(M_CARD)

    def give_back(self, nbytes: int) -> None:
        """What a process that is gone held: the driver freed it with the process."""
        _words.sub_u64_floor(self.map.addr + M_USED, nbytes)

    def cap_bytes(self, word: int) -> int:
        """The cap in bytes for its policy word (a fraction needs the card's size: 0 until known)."""
        if word & MEM_CAP_FRACTION:
            return (word & 0xFFFFFFFF) * self.card_bytes // 1_000_000
        return word

    def close(self) -> None:
        self.map.close()


class LedgerFiles:
    """What a ledger prefix names on the filesystem: the lock (one controller per prefix) and the join
    socket, with the server that admits processes to the GPUs' ledgers (one ``Policy`` each)."""

    def __init__(self, prefix: str, *, log: Callable[[str], None] | None = None) -> None:
        check_prefix(prefix)  # before anything is created
        self.prefix = prefix
        self.lock = LedgerLock(prefix)
        try:
            sock, self._sock_inode = listen_socket(prefix)
        except BaseException:
            self.lock.release()
            raise
        self.joins = JoinServer(sock, layout_version=LAYOUT_VERSION, log=log)
        self._started = False

    def start(self) -> None:
        """Admit processes (once every GPU's ledger is added)."""
        if not self._started:
            self._started = True
            self.joins.start()

    def close(self) -> None:
        """Stop admitting, remove the socket and the lock."""
        self.joins.stop()
        remove_socket(self.prefix, self._sock_inode)
        self.lock.release()


class Policy:
    """The controller's side of one GPU's ledger: creates the policy and bell pages, writes the gate,
    and admits tenant processes through the join socket (``joins.JoinServer``). It holds the lock and
    the socket itself, or shares ``files`` with the other GPUs' ledgers (``uuid``: its GPU's, to
    which the join server sends the hellos naming it)."""

    def __init__(self, prefix: str, tenants: Sequence[TenantPolicy], *, mode: str = "events",
                 window_us: int = DEFAULT_WINDOW_US, inflight_slice: int = DEFAULT_QUEUED_WINDOWS,
                 inflight_open: int = DEFAULT_INFLIGHT_OPEN, beside_queue_us: int = DEFAULT_BESIDE_QUEUE_US,
                 stale_ms: int = DEFAULT_STALE_MS, priority_hold: bool = False, access: Access | None = None,
                 log: Callable[[str], None] | None = None, files: LedgerFiles | None = None,
                 uuid: bytes = b"") -> None:
        if not 1 <= len(tenants) <= MAX_TENANTS:
            raise ValueError(f"between 1 and {MAX_TENANTS} tenants, not {len(tenants)}")
        for t in tenants:
            if not t.name.encode() or len(t.name.encode()) >= NAME_LEN:
                raise ValueError(f"tenant name {t.name!r} must be 1 to {NAME_LEN - 1} bytes")
        self.prefix = prefix
        self.tenants = list(tenants)
        self.window_us = window_us
        self._fds: list[int] = []
        self._own_files = files is None
        self.files = files if files is not None else LedgerFiles(prefix, log=log)
        try:
            self._build(mode, window_us, inflight_slice, inflight_open, beside_queue_us, stale_ms,
                        priority_hold)
        except BaseException:
            self._close_pages()
            if self._own_files:
                self.files.close()
            raise
        self.joins = self.files.joins
        self.device = Device(uuid, _joinable(self.tenants), access or Access(), self._shared_fds,
                             _new_proc_page, self.ring)
        self.joins.add(self.device)
        if self._own_files:
            self.files.start()

    def _build(self, mode: str, window_us: int, inflight_slice: int, inflight_open: int,
               beside_queue_us: int, stale_ms: int, priority_hold: bool) -> None:
        bell_fd, policy_fd = sealed_page("gpuscope-share-bell"), sealed_page("gpuscope-share-policy")
        self._fds += [bell_fd, policy_fd]
        self._fds.append(read_only(policy_fd))
        self.bell = Mapping(bell_fd, writable=True, name="the bell")
        self.map = Mapping(policy_fd, writable=True, name="the policy")
        self._tenant_fds = [sealed_page(f"gpuscope-share-tenant{i}") for i in range(len(self.tenants))]
        self.memory = [TenantMemory(fd, t.name) for fd, t in zip(self._tenant_fds, self.tenants, strict=True)]
        m = self.map
        m.set_u32(P_VERSION, LAYOUT_VERSION)
        ctypes.c_int32.from_address(m.addr + P_PID).value = os.getpid()
        m.set_u32(P_NTENANTS, len(self.tenants))
        m.set_u32(P_MODE, MODES[mode])
        for off, value in ((P_WINDOW_US, window_us), (P_INFLIGHT_SLICE, inflight_slice),
                           (P_INFLIGHT_OPEN, inflight_open), (P_BESIDE_QUEUE_US, beside_queue_us),
                           (P_STALE_MS, stale_ms), (P_PRIORITY_HOLD, int(priority_hold))):
            m.set_u32(off, value)
        self._write_entries()
        self.gen = 1
        m.set_u32(P_GATE, (self.gen << 16) | OPEN_MASK)
        self.heartbeat()
        m.set_u32(P_MAGIC, POLICY_MAGIC)

    def _write_entries(self) -> None:
        """Every tenant's entry, then how many there are (a process reads an entry only below it)."""
        m = self.map
        for i, t in enumerate(self.tenants):
            base = P_TENANTS + i * TENANT_SIZE
            name = t.name.encode()
            ctypes.memmove(m.addr + base, name, len(name))
            m.set_u32(base + T_SHARE, round(t.share * 1e6))
            m.set_u32(base + T_PRIORITY, t.priority)
            m.set_u32(base + T_ACTIVE, 1 if t.share > 0 else 0)
            m.set_u64(base + T_MEM_CAP, t.mem_cap_word())
        m.set_u32(P_NTENANTS, len(self.tenants))

    def set_tenants(self, tenants: Sequence[TenantPolicy], access: Access | None = None) -> None:
        """A new policy, slot for slot: ``tenants`` keeps the current slots in order (a tenant removed
        has share 0: its running processes keep their slot, new ones may not join) and may add some."""
        if len(tenants) > MAX_TENANTS or [t.name for t in tenants[:len(self.tenants)]] != \
                [t.name for t in self.tenants]:
            raise ValueError(f"a new policy keeps the slots of the old one, at most {MAX_TENANTS}")
        for i in range(len(self.tenants), len(tenants)):
            fd = sealed_page(f"gpuscope-share-tenant{i}")
            self._tenant_fds.append(fd)
            self.memory.append(TenantMemory(fd, tenants[i].name))
        self.tenants = list(tenants)
        self._write_entries()
        self.joins.set_tenants(self.device, _joinable(self.tenants), access)

    def _shared_fds(self, slot: int) -> tuple[int, int, int]:
        """What a tenant's joining process gets besides its own page: the policy (read-only), the bell
        and its tenant's memory page."""
        return self._fds[2], self._fds[0], self._tenant_fds[slot]

    def mem_cap_bytes(self, slot: int) -> int:
        """Tenant ``slot``'s memory cap in bytes (0: none, or a fraction of a card not seen yet)."""
        return self.memory[slot].cap_bytes(self.map.u64(P_TENANTS + slot * TENANT_SIZE + T_MEM_CAP))

    def ring(self) -> None:
        """Wake the controller's loop (or turn keeper) sleeping on the bell, as a tenant would. Not an
        atomic add: racing a tenant's ring can only merge the two, and the word moved either way."""
        addr = self.bell.addr
        ctypes.c_uint32.from_address(addr).value = (self.bell.u32(0) + 1) & 0xFFFFFFFF
        self.bell.futex_wake(0)

    def take_joins(self) -> list[JoinEvent]:
        """Processes that joined or left since the last call, in order."""
        return self.joins.take(self.device)

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
    def lender_mask_address(self) -> int:
        return self.map.addr + P_LENDER_MASK

    @property
    def lender_mask(self) -> int:
        return self.map.u32(P_LENDER_MASK)

    def set_lender_mask(self, mask: int) -> None:
        """Mark the slots in ``mask`` as having lent the rest of their turn: a thread of theirs held at
        the gate rings the bell, so the turn comes back at once."""
        self.map.set_u32(P_LENDER_MASK, mask & 0xFFFF)

    @property
    def hold_mask_address(self) -> int:
        return self.map.addr + P_HOLD_MASK

    @property
    def hold_mask(self) -> int:
        return self.map.u32(P_HOLD_MASK)

    @property
    def turns_mask(self) -> int:
        return self.map.u32(P_TURNS_MASK)

    def set_turns_mask(self, mask: int) -> None:
        """Mark the slots in ``mask`` as taking turns. A holder with no other slot in it has nobody
        waiting for its hand-over or its lent time, and its helper thread looks at it only now and
        then; the helpers are woken to look at the new mask at once."""
        if self.map.u32(P_TURNS_MASK) != mask & 0xFFFF:
            self.map.set_u32(P_TURNS_MASK, mask & 0xFFFF)
            self.map.futex_wake(P_GATE)

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
        hand-over (only when another tenant's probe pauses them)."""
        self.map.set_u32(P_BESIDE_MASK, mask & 0xFFFF)

    def duty(self, slot: int) -> float:
        ppm = self.map.u32(P_TENANTS + slot * TENANT_SIZE + T_DUTY)
        return 1.0 if ppm == 0 else ppm / 1e6

    def set_duty(self, slot: int, fraction: float) -> None:
        """Let tenant ``slot``, beside the holder or the lone holder, launch only in the first
        ``fraction`` of every duty period (1: always)."""
        ppm = 0 if fraction >= 1 else max(1, round(max(0.0, fraction) * 1e6))
        self.map.set_u32(P_TENANTS + slot * TENANT_SIZE + T_DUTY, ppm)

    def bell_value(self) -> int:
        return self.bell.u32(0)

    def wait_bell(self, seen: int, timeout_s: float) -> None:
        """Sleep until a tenant rings (the bell's word moves past ``seen``) or ``timeout_s`` passes."""
        if timeout_s > 0:
            self.bell.futex_wait(0, seen, timeout_s)

    def _close_pages(self) -> None:
        for page in (getattr(self, "map", None), getattr(self, "bell", None), *getattr(self, "memory", ())):
            if page is not None:
                page.close()
        for fd in [*self._fds, *getattr(self, "_tenant_fds", ())]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def close(self) -> None:
        """Stop admitting tenants, remove the socket and the lock (where this ledger holds them). Tenants
        keep their mappings of the pages (the memory lives while anyone maps it) and fail open once the
        heartbeat stops."""
        if self._own_files:
            self.files.close()
        self._close_pages()


class ProcView:
    """A tenant process's page, as the controller created it: its counters, written by the process.

    ``pid``, ``slot`` and ``tenant`` are the controller's own record of who joined (from the kernel and
    the admission rules), never read back from the page the process can write."""

    def __init__(self, fd: int, pid: int, slot: int, tenant: str) -> None:
        self.map = Mapping(fd, writable=True, name=f"the page of pid {pid}")
        self.pid, self.slot, self.tenant = pid, slot, tenant
        m = self.map
        ctypes.c_int32.from_address(m.addr + Q_PID).value = pid
        ctypes.c_int32.from_address(m.addr + Q_SLOT).value = slot
        name = tenant.encode()[:NAME_LEN - 1]
        ctypes.memmove(m.addr + Q_TENANT, name, len(name))
        m.set_u32(Q_VERSION, LAYOUT_VERSION)
        m.set_u32(Q_MAGIC, PROC_MAGIC)
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


def _joinable(tenants: Sequence[TenantPolicy]) -> list[str | None]:
    """The names processes may join as, slot for slot (None: a slot whose tenant was removed)."""
    return [t.name if t.share > 0 else None for t in tenants]


def _new_proc_page(pid: int, slot: int, tenant: str) -> tuple[int, ProcView]:
    """A joining process's page: sealed, its header written by the controller."""
    fd = sealed_page(f"gpuscope-share-pid{pid}")
    try:
        return fd, ProcView(fd, pid, slot, tenant)
    except BaseException:
        os.close(fd)
        raise


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
