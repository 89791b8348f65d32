"""The share controller's process table: the tenant processes that joined, and what their pages say.

Processes are adopted from the ledger's join events (never found by scanning: a process joins over
its connection, and the controller records who it is from the kernel) and forgotten when their
connection ends or they die; a departed process's counters are summed under its tenant, and the
memory it held is given back to its tenant's count (the driver frees it when a process ends).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpuscope.share.ledger import QUIET_NS, Policy, ProcView, pid_alive

#: A tenant counts as active (shares bind while two are) this long after its last launch.
ACTIVE_S = 0.5
#: The holder still wants its slice if it launched this recently.
HOLDER_RECENT_S = 0.002
#: A process that left still counts as joined for this long, for the unmanaged-process watch.
LEFT_GRACE_S = 5.0


@dataclass
class ProcState:
    view: ProcView
    gpu_ns_seen: int = 0
    launches_seen: int = 0


#: More threads in one process waiting for the GPU at once than this is a page written by hand.
MAX_WAITING_THREADS = 1 << 16


def waited_ns(view: ProcView, now_ns: int) -> int:
    """One process's time in its waits for the GPU up to ``now_ns``: those ended, and the part so far
    of those under way (their count times now, less the sum of their starts). The ended time is read
    first and the waits under way after it, so a wait that ends between the reads is missed, never
    counted twice; a torn read of the two words under way (outside 0 .. count x the time since the
    process joined), or a count no process's threads could make (the page is the tenant's to write),
    counts nothing of them."""
    ended = view.counter("sync_wait_ns")
    under_way_count = view.counter("sync_open")
    if under_way_count > MAX_WAITING_THREADS:
        return ended
    under_way = under_way_count * now_ns - view.counter("sync_open_since_ns")
    since_join = max(0, now_ns - view.counter("started_ns"))
    return ended + (under_way if 0 <= under_way <= under_way_count * since_join else 0)


class ProcessTable:
    """The joined processes by pid. Its methods that change the table take ``lock``; the queries
    are called by the controller's loop with the lock held (or from the loop's own thread)."""

    def __init__(self, policy: Policy, lock: threading.Lock, tenant_name: Callable[[int], str],
                 departed: dict[str, dict[str, int]]) -> None:
        """``departed``: where the counters of processes that left are summed, by tenant (a slot keeps
        its tenant across policy changes, so ``tenant_name`` may be asked at any time)."""
        self.policy = policy
        self.lock = lock
        self.tenant_name = tenant_name
        self.departed = departed
        self.procs: dict[int, ProcState] = {}
        self._left: dict[int, float] = {}  # pid -> when it was forgotten (recent ones only)

    def __iter__(self) -> Iterator[ProcState]:
        return iter(list(self.procs.values()))

    def __len__(self) -> int:
        return len(self.procs)

    def adopt(self) -> None:
        """Take the processes that joined and forget those whose connection ended (at every step: a
        joined process must not wait for the next liveness check to count, or be seen as unmanaged)."""
        events = self.policy.take_joins()
        if not events:
            return
        with self.lock:
            for event in events:
                if event.pid in self.procs:  # it left, or its pid was reused by a newer joiner
                    self._forget(event.pid)
                if event.kind == "join":
                    self.procs[event.pid] = ProcState(event.page)

    def scan(self, *, zombie_check: bool = True) -> None:
        """Adopt new processes and forget those that left or died (their shares are given back).
        Liveness is checked with ``kill(pid, 0)``; ``zombie_check`` also reads /proc, which tells a
        process that exited but was not reaped yet."""
        self.adopt()
        with self.lock:
            for pid in list(self.procs):
                if not pid_alive(pid, zombie_check=zombie_check):
                    self._forget(pid)

    def _forget(self, pid: int) -> None:
        state = self.procs.pop(pid)
        totals = self.departed.setdefault(self.tenant_name(state.view.slot), {})
        counters = state.view.counters()
        for name, value in counters.items():
            totals[name] = totals.get(name, 0) + value
        self.policy.memory[state.view.slot].give_back(counters["mem_bytes"])
        state.view.close()
        self._left[pid] = time.monotonic()

    def joined_pids(self) -> list[int]:
        """The pids of the processes that joined, with those that left in the last ``LEFT_GRACE_S`` (for
        the unmanaged-process watch: NVML lists a process until the driver has torn its context down,
        which outlasts the end of its connection)."""
        now = time.monotonic()
        with self.lock:
            self._left = {pid: t for pid, t in self._left.items() if now - t < LEFT_GRACE_S}
            return [*self.procs, *self._left]

    def tenants_by_pid(self) -> dict[int, str]:
        with self.lock:
            return {pid: self.tenant_name(state.view.slot) for pid, state in self.procs.items()}

    # --- what the pages say (called with the lock held) ---------------------------------------------
    def slot_of(self, pid: int) -> int | None:
        state = self.procs.get(pid)
        return None if state is None else state.view.slot

    def attached_slots(self) -> set[int]:
        return {s.view.slot for s in self.procs.values()}

    def active_slots(self) -> set[int]:
        now_ns = time.monotonic_ns()
        return {s.view.slot for s in self.procs.values()
                if s.view.waiting or now_ns - s.view.counter("last_launch_ns") < ACTIVE_S * 1e9}

    def wanting_slots(self, holder: int | None) -> set[int]:
        """Slots with a thread held at the gate, plus the holder while it still has work."""
        recent_ns = time.monotonic_ns() - HOLDER_RECENT_S * 1e9
        out = set()
        for s in self.procs.values():
            v = s.view
            if v.waiting or (v.slot == holder and (v.counter("window_open") or v.counter("inflight")
                                                   or v.counter("last_launch_ns") > recent_ns)):
                out.add(v.slot)
        return out

    def quiet(self, slot: int | None) -> bool:
        """Whether ``slot`` has nothing held, open or queued, and no launch for ``QUIET_NS``."""
        now_ns = time.monotonic_ns()
        for state in self.procs.values():
            v = state.view
            if v.slot == slot and (v.waiting or v.counter("window_open") or v.counter("inflight")
                                   or now_ns - v.counter("last_launch_ns") < QUIET_NS):
                return False
        return True

    def busy(self, slot: int) -> tuple[int, int]:
        """``slot``'s processes' summed busy time (posted while probed) and launches timed so."""
        ns = launches = 0
        for state in self.procs.values():
            if state.view.slot == slot:
                ns += state.view.counter("busy_ns")
                launches += state.view.counter("busy_launches")
        return ns, launches

    def sync_wait_ns(self, slot: int, now: float) -> int:
        """``slot``'s processes' summed time in their waits for the GPU up to ``now`` (a
        ``time.monotonic()`` reading: CLOCK_MONOTONIC, the library's clock), the waits under way
        included: the time waited between two readings is then exact at both ends. Counted only as
        each wait ended, a wait that began before a probe's 10 ms lead and ended in it (its kernel
        queued behind the other tenant's, drained as the lead began) counted whole in the lead: the
        tenant read waiting all its time alone, where it waited 0.6 of it, and was never found
        starved beside the holder."""
        now_ns = int(now * 1e9)
        return sum(waited_ns(s.view, now_ns) for s in self.procs.values() if s.view.slot == slot)

    def launches(self, slot: int) -> int:
        """``slot``'s processes' summed launches (a graph's launch counts one)."""
        return sum(s.view.counter("launches") for s in self.procs.values() if s.view.slot == slot)

    def keeper_view(self) -> tuple[tuple[int, int, int], ...]:
        """(slot, pid, page address) of each process, for the turn keeper in C."""
        return tuple((state.view.slot, pid, state.view.address) for pid, state in self.procs.items())

    def close(self) -> None:
        with self.lock:
            for pid in list(self.procs):
                self.procs.pop(pid).view.close()
