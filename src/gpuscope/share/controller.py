"""The share controller's loop: finds tenant processes, decides who may launch, writes the gate.

It never touches the GPU itself in ``events`` mode: the tenants' preload library measures GPU time
with CUDA events and posts it to their slots; the controller charges it and hands out slices. In
``nvml`` mode it samples per-process utilization from NVML every 100 ms for the token buckets.

The loop sleeps on the ledger's bell (a futex) between decisions, so it costs nothing while no share
binds and a few wake-ups per slice while one does.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuscope.share.access import Access
from gpuscope.share.ledger import (
    KEEPER_OFFSETS,
    MAX_TENANTS,
    OPEN_MASK,
    QUIET_NS,
    Policy,
    ProcView,
    TenantPolicy,
    pid_alive,
)
from gpuscope.share.policy import PolicyFile, PolicySpec
from gpuscope.share.scheduler import SliceScheduler, TokenBuckets, own_time
from gpuscope.share.settings import (
    PROBE_FIRST_S,
    PROBE_READ_LAG_S,
    PROBE_S,
    Accounting,
    Handover,
    ShareSettings,
    Turns,
)

try:
    from gpuscope.share import _turns
except ImportError:  # no compiler where gpuscope was installed: the Python loop hands over (more CPU)
    _turns = None

#: The settings of a controller made without any (the command's defaults).
DEFAULTS = ShareSettings()

#: A tenant counts as active (shares bind while two are) this long after its last launch.
ACTIVE_S = 0.5
#: How often the controller checks that its tenant processes live (a dead one's share is given back),
#: and how often it also reads /proc to tell a zombie (exited, not yet reaped by its parent).
SCAN_S, ZOMBIE_CHECK_S = 0.1, 2.0
#: How often the loop looks while shares do not bind: with tenant processes attached (a second one
#: starting to launch makes them bind), and with none (a process that joins rings the bell; the
#: heartbeat must still move well inside the tenants' 2 s staleness limit). Looking more often costs
#: an idle controller CPU for nothing.
OPEN_POLL_S, NO_TENANTS_POLL_S = 0.25, 0.5
#: The holder still wants its slice if it launched this recently.
HOLDER_RECENT_S = 0.002
#: A holder that goes quiet (nothing queued, no launch) with more than this left of its turn while
#: others wait lends them the rest of it and keeps its claim: its next launch takes the turn back
#: (a training step's host work between its kernels would otherwise cost it the whole turn).
LEND_MIN_S = 0.001
#: While tenants run concurrently their posted GPU time is summed over at least this long and, when
#: it exceeds the wall time (time-sliced contexts' event spans overlap), the overlap is split.
CONCURRENT_PERIOD_S = 0.05
#: Weight of a new probe's busy fraction in the running estimate.
PROBE_WEIGHT = 0.5
#: While tenants take turns the hand-overs run in C (``_turns``), and the Python loop takes control
#: back this often to charge posted time, update the active set and start probes (the C loop itself
#: returns at once when a tenant process exits). Each return costs a wake-up of the interpreter on a
#: cold cache, as each hand-over did when they were decided in Python (docs/share.md, "The turn keeper").
KEEPER_RETURN_S = 0.25
#: With draining hand-overs the holder stops at its slice's end by itself (it sees the end in the
#: policy), drains its queue and rings: one wake-up of the keeper per hand-over instead of two. The
#: keeper waits this many accounting windows past the end for that before it drains the holder itself
#: (the yield comes at its next launch, and the queue holds two windows).
YIELD_GRACE_WINDOWS = 4

#: A process that left still counts as joined for this long, for the unmanaged-process watch.
LEFT_GRACE_S = 5.0
#: How often the policy file (--share.policy-file) is looked at for a change (a stat() call): a change
#: is applied within this, and the turn keeper takes it at its next return (KEEPER_RETURN_S).
POLICY_CHECK_S = 0.5

UtilizationSource = Callable[[], Mapping[int, float]]  # pid -> fraction of the GPU, last 100 ms


@dataclass
class ProcState:
    view: ProcView
    gpu_ns_seen: int = 0
    launches_seen: int = 0


@dataclass
class Probe:
    """A pause of the holder while the tenants beside it time their launches alone."""

    until: float
    started: float
    busy_ns: dict[int, int]  # slot -> its processes' busy_ns when the probe began
    read_at: float = 0.0  # once ended: when its windows have been posted


@dataclass
class Stats:
    """What /metrics shows besides the processes' own counters."""

    slices: dict[str, int] = field(default_factory=dict)
    charged_s: dict[str, float] = field(default_factory=dict)  # GPU seconds charged, after correction
    drain_timeouts: int = 0
    yields: int = 0  # draining hand-overs where the holder yielded at its slice's end by itself
    lends: int = 0  # quiet holders that lent the rest of their turn
    reclaims: int = 0  # lent turns taken back by their lender before they ended
    probes: int = 0
    state_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (tenant, gate state) -> seconds
    departed: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> summed counters
    binding: bool = False
    policy_reloads: dict[str, int] = field(default_factory=lambda: {"applied": 0, "refused": 0})


@dataclass(frozen=True)
class Snapshot:
    """What /metrics shows of a controller, copied at one moment under its lock."""

    tenants: tuple[TenantPolicy, ...]
    processes: tuple[tuple[str, int, dict[str, int]], ...]  # tenant, pid, counters (and "waiting")
    stats: Stats
    busy_ratio: dict[str, float]  # tenant -> busy fraction of its probes (tenants beside the holder)
    duty: dict[str, float]  # tenant beside the holder -> its duty
    joins: dict[str, int]
    memory: tuple[tuple[str, int, int, int], ...]  # tenant, bytes held, refusals, cap in bytes (0: none)


class Controller:
    def __init__(self, prefix: str, tenants: list[TenantPolicy], settings: ShareSettings = DEFAULTS, *,
                 utilization: UtilizationSource | None = None, access: Access | None = None,
                 log: Callable[[str], None] | None = None, policy_file: PolicyFile | None = None) -> None:
        """``settings``: the command's flags as they are (``--share.slice``, ``--share.handover``...);
        ``tenants``, ``access`` and ``policy_file`` replace its ``--share`` and ``--share.allow``."""
        self.log = log or (lambda line: sys.stderr.write(line + "\n"))
        self.settings = settings
        self.policy = Policy(prefix, tenants, mode=str(settings.accounting),
                             window_us=int(settings.window * 1e6), inflight_slice=settings.queued_windows,
                             access=access, log=self.log)
        self.tenants = tenants
        self.mode = settings.accounting
        self.slice_s = settings.slice
        self.probe_every_s = settings.probe_every
        self.drain_timeout_s = settings.drain_timeout
        self.handover = settings.handover
        # hand-overs between slice holders in C (nvml mode has none: it stays in Python)
        self.keeper = settings.turns == Turns.C and _turns is not None and self.mode == Accounting.EVENTS
        self.scheduler = SliceScheduler(tenants)
        self.buckets = TokenBuckets(tenants)
        self.utilization = utilization
        self.procs: dict[int, ProcState] = {}
        self.holder: int | None = None  # None: the gate is open
        self.lender: int | None = None  # the tenant whose turn the holder runs in (it lent the rest)
        self.lend_end = 0.0
        self.slice_end = 0.0
        self._slice_start = 0.0
        self._posted_in_slice = 0.0
        self.stats = Stats(slices={t.name: 0 for t in tenants}, charged_s={t.name: 0.0 for t in tenants})
        self.beside: set[int] = set()  # slots running beside the holder (higher priority, within share)
        self.busy_ratio: dict[int, float] = {}  # slot -> busy fraction measured in probes (beside tenants)
        self.duty: dict[int, float] = {}  # slot -> part of the time it may launch, beside (below 1: over)
        self.probe: Probe | None = None
        self._next_probe = 0.0
        self._unscaled: dict[int, float] = {}  # GPU seconds posted while tenants ran concurrently
        self._unscaled_since: float | None = None
        self._last_charge = self._last_state_count = time.monotonic()
        self.lock = threading.Lock()  # /metrics reads procs while the loop changes them
        self._last_scan = self._last_zombie_check = 0.0
        self._left: dict[int, float] = {}  # pid -> when it was forgotten (recent ones only)
        self.policy_file = policy_file
        self._last_policy_check = time.monotonic()
        self.reload_now = False  # set by SIGHUP: look at the policy file at the next step
        self._last_sample = 0.0
        self._mask = OPEN_MASK
        self._nvml_samples = self._nvml_matched = 0

    # --- processes --------------------------------------------------------------------------
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
        tenant = self.tenants[state.view.slot].name
        totals = self.stats.departed.setdefault(tenant, {})
        counters = state.view.counters()
        for name, value in counters.items():
            totals[name] = totals.get(name, 0) + value
        # the driver frees what a process held when it ends: give it back to its tenant's count
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
            return {pid: self.tenants[state.view.slot].name for pid, state in self.procs.items()}

    def snapshot(self) -> Snapshot:
        """A consistent copy of what the metrics show, taken under the lock."""
        with self.lock:
            names = [t.name for t in self.tenants]
            return Snapshot(
                tenants=tuple(self.tenants),
                processes=tuple((names[s.view.slot], pid, {**s.view.counters(), "waiting": s.view.waiting})
                                for pid, s in self.procs.items()),
                stats=copy.deepcopy(self.stats),
                busy_ratio={names[slot]: r for slot, r in self.busy_ratio.items()},
                duty={names[slot]: self.duty.get(slot, 1.0) for slot in self.beside},
                joins=dict(self.policy.joins.results),
                memory=tuple((t.name, page.used, page.refused, self.policy.mem_cap_bytes(slot))
                             for slot, (t, page) in enumerate(zip(self.tenants, self.policy.memory,
                                                                  strict=True))))

    def charged_seconds(self) -> dict[str, float]:
        with self.lock:
            return dict(self.stats.charged_s)

    def _charge(self, now: float) -> None:
        """Charge the GPU time the processes posted since the last call.

        While one tenant holds the GPU alone its posted time is its own and is charged at once. While
        several run at once (the open gate, or tenants beside the holder) their event spans overlap
        whenever the GPU time-slices them, so what they post over a period that sums to more than the
        period's wall time is corrected by ``own_time``: the tenants beside the holder post their
        kernels' own time, the others share what is left."""
        since, self._last_charge = self._last_charge, now
        posted: dict[int, float] = {}
        launching: set[int] = set()
        for state in self.procs.values():
            slot = state.view.slot
            gpu_ns, launches = state.view.counter("gpu_ns"), state.view.counter("launches")
            if launches > state.launches_seen:
                launching.add(slot)
                state.launches_seen = launches
            if gpu_ns > state.gpu_ns_seen:
                if slot not in self.beside:  # beside: only probes post, and the busy ratio stands for them
                    posted[slot] = posted.get(slot, 0.0) + (gpu_ns - state.gpu_ns_seen) / 1e9
                state.gpu_ns_seen = gpu_ns
        for slot in self.beside & launching:  # busy for its part of the time (its duty)
            share_of_time = self.busy_ratio.get(slot, 0.0) * self.duty.get(slot, 1.0)
            posted[slot] = posted.get(slot, 0.0) + share_of_time * (now - since)
        # several tenants at once: the open gate, tenants beside the holder, or (overlap hand-overs) the
        # previous holder's queued work running beside the next one's
        concurrent = (bin(self._mask & OPEN_MASK).count("1") > 1
                      or (self.handover == Handover.OVERLAP and self._mask != OPEN_MASK))
        if not concurrent and self._unscaled_since is None:
            self._apply(posted, now)
            return
        if self._unscaled_since is None:
            self._unscaled_since = since
        for slot, seconds in posted.items():
            self._unscaled[slot] = self._unscaled.get(slot, 0.0) + seconds
        wall = now - self._unscaled_since
        if concurrent and wall < CONCURRENT_PERIOD_S:
            return
        self._apply(own_time(self._unscaled, wall, self.beside), now)
        self._unscaled, self._unscaled_since = {}, (now if concurrent else None)

    def _apply(self, charged: Mapping[int, float], now: float) -> None:
        for slot, seconds in charged.items():
            self.stats.charged_s[self.tenants[slot].name] += seconds
            if self._mask == OPEN_MASK:
                # With the gate open every tenant's windows span the others' work (and a latency-bound
                # tenant's its own idle gaps): shown, but not held against anyone once shares bind.
                continue
            self.scheduler.charge(slot, seconds, now)
            if slot == self.holder:
                self._posted_in_slice += seconds

    def _pending(self, now: float) -> dict[int, float]:
        """The holder's slice so far, less what its processes already posted: its unposted GPU time
        (at most the slice's wall time, since it held the GPU alone)."""
        if self.holder is None:
            return {}
        return {self.holder: max(0.0, now - self._slice_start - self._posted_in_slice)}

    def active_slots(self) -> set[int]:
        now_ns = time.monotonic_ns()
        return {s.view.slot for s in self.procs.values()
                if s.view.waiting or now_ns - s.view.counter("last_launch_ns") < ACTIVE_S * 1e9}

    def wanting_slots(self) -> set[int]:
        """Slots with a thread held at the gate, plus the holder while it still has work."""
        now_ns = time.monotonic_ns()
        out = set()
        for s in self.procs.values():
            v = s.view
            if v.waiting or (v.slot == self.holder and (v.counter("window_open") or v.counter("inflight")
                                            or now_ns - v.counter("last_launch_ns") < HOLDER_RECENT_S * 1e9)):
                out.add(v.slot)
        return out

    # --- the gate ---------------------------------------------------------------------------
    def _set_mask(self, mask: int) -> int:
        self._mask = mask
        return self.policy.set_gate(mask)

    def _set_duties(self, active: set[int]) -> None:
        """Hold each tenant beside the holder to its share by its duty (``SliceScheduler.duty``)."""
        for slot in range(len(self.tenants)):
            duty = (self.scheduler.duty(slot, active, self.busy_ratio.get(slot))
                    if slot in self.beside else 1.0)
            if duty != self.duty.get(slot, 1.0):
                self.policy.set_duty(slot, duty)
                self.duty[slot] = duty

    def _beside_bits(self) -> int:
        return sum(1 << s for s in self.beside)

    def _set_beside(self, beside: set[int], now: float) -> None:
        """Let ``beside`` run next to the holder (untimed, never drained); the gate follows."""
        if beside == self.beside:
            return
        if any(slot not in self.busy_ratio for slot in beside - self.beside):  # never probed: soon
            first = now + PROBE_FIRST_S
            self._next_probe = first if self._next_probe <= now else min(self._next_probe, first)
        self.beside = beside
        self.policy.set_beside_mask(self._beside_bits())
        if self.holder in beside:
            self.holder = None  # it keeps running, now beside: the contenders pick a holder anew
        if self._mask != OPEN_MASK:
            self._set_mask(self._beside_bits() | (1 << self.holder if self.holder is not None else 0))

    def _set_lender(self, slot: int | None, end: float = 0.0) -> None:
        self.lender, self.lend_end = slot, end
        self.policy.set_lender_mask(0 if slot is None else 1 << slot)

    def _holder_quiet(self) -> bool:
        """Whether the holder has nothing held, open or queued, and no launch for ``QUIET_NS``."""
        now_ns = time.monotonic_ns()
        for state in self.procs.values():
            v = state.view
            if v.slot == self.holder and (v.waiting or v.counter("window_open") or v.counter("inflight")
                                          or now_ns - v.counter("last_launch_ns") < QUIET_NS):
                return False
        return True

    def _lend_or_reclaim(self, now: float, wanting: set[int]) -> bool:
        """Work-conserving turns: a holder with nothing to run lends the rest of its turn to the
        tenant the scheduler picks, keeping its claim; its next launch (a held thread rings the
        bell) takes the turn back, after the borrower's one queued window when draining. Each is
        charged the GPU time it posted. Returns whether the gate changed."""
        holder = self.holder
        if self.lender is not None:
            if self.lender not in wanting:
                return False
            lender, end = self.lender, self.lend_end
            if self.handover == Handover.DRAIN:
                self._drain({holder})
                self._charge(time.monotonic())
            self._set_lender(None)
            self.stats.reclaims += 1
            now = time.monotonic()
            self._grant(lender, now, wanting)
            self.slice_end = max(end, now)
            return True
        others = wanting - {holder}
        if not self._holder_quiet() or not others or self.slice_end - now < LEND_MIN_S:
            return False
        borrower = self.scheduler.pick(others, now, self._pending(now))
        end = self.slice_end
        self._set_lender(holder, end)  # before the gate opens to the borrower: the lender's waiter rings
        self.stats.lends += 1
        self._grant(borrower, time.monotonic(), others)
        self.slice_end = end
        return True

    def _lend_claimed_turn(self, now: float, wanting: set[int]) -> bool:
        """At a turn's end, the tenant whose turn it was (the holder, or the one that lent it its turn)
        keeps its claim while it is idle and within its share: the turn the scheduler would give it
        is lent at once to those who want the GPU, and its next launch takes it back (a training
        loop on the host at its turn's end otherwise waited out the other tenant's whole turn)."""
        holder = self.holder
        claimant = holder if self.lender is None else self.lender
        self._set_lender(None)
        borrowers = wanting - {claimant}
        pending = self._pending(now)
        if claimant in wanting or not self.scheduler.keeps_claim(claimant, borrowers, now, pending):
            return False
        borrower = self.scheduler.pick(borrowers, now, pending)
        if borrower != holder and self.handover == Handover.DRAIN and holder in wanting:
            self._drain({holder})
            self._charge(time.monotonic())
        now = time.monotonic()
        end = now + self.scheduler.quantum(claimant, wanting | {claimant}, self.slice_s)
        self._set_lender(claimant, end)
        self.stats.lends += 1
        if borrower == holder:
            self._renew(now, wanting)
        else:
            self._grant(borrower, now, wanting)
        self.slice_end = end
        return True

    def _drain(self, slots: set[int]) -> None:
        """Close the gate to ``slots`` and wait until their processes have nothing queued (the
        tenants beside the holder keep running)."""
        gen = self._set_mask(self._beside_bits())
        for state in list(self.procs.values()):
            if state.view.slot not in slots:
                continue
            # the heartbeat goes on while it waits: a drain may last longer than the tenants' 2 s limit
            if (not state.view.wait_drained(gen, self.drain_timeout_s, tick=self.policy.heartbeat)
                    and pid_alive(state.view.pid)):
                self.stats.drain_timeouts += 1

    def _grant(self, slot: int, now: float, wanting: set[int]) -> None:
        self.holder = slot
        self._renew(now, wanting)
        self._set_mask((1 << slot) | self._beside_bits())

    def _renew(self, now: float, wanting: set[int]) -> None:
        self._slice_start, self._posted_in_slice = now, 0.0
        self.slice_end = now + self.scheduler.quantum(self.holder, wanting | {self.holder}, self.slice_s)
        self.stats.slices[self.tenants[self.holder].name] += 1

    # --- probes: the busy fraction of the tenants beside the holder ----------------------------
    def _busy_ns(self, slots: set[int]) -> dict[int, int]:
        out = dict.fromkeys(slots, 0)
        for state in self.procs.values():
            if state.view.slot in out:
                out[state.view.slot] += state.view.counter("busy_ns")
        return out

    def _start_probe(self, now: float) -> None:
        """Pause the holder (its queued work drained first) and have the tenants beside it time each
        launch, running alone."""
        self._drain(set(range(len(self.tenants))) - self.beside)
        self.holder = None
        started = time.monotonic()
        self.probe = Probe(until=started + PROBE_S, started=started, busy_ns=self._busy_ns(self.beside))
        self.policy.set_busy_mask(self._beside_bits())
        self.stats.probes += 1

    def _end_probe(self, now: float) -> None:
        self.policy.set_busy_mask(0)
        self.probe.until, self.probe.read_at = now, now + PROBE_READ_LAG_S
        self._next_probe = now + self.probe_every_s

    def _read_probe(self, now: float) -> None:
        """Once an ended probe's windows are posted: each probed tenant's busy fraction."""
        probe, self.probe = self.probe, None
        wall = max(probe.until - probe.started, 1e-6)
        after = self._busy_ns(set(probe.busy_ns))
        for slot, before in probe.busy_ns.items():
            measured = min(1.0, (after[slot] - before) / 1e9 / wall)
            old = self.busy_ratio.get(slot)
            self.busy_ratio[slot] = measured if old is None else old + PROBE_WEIGHT * (measured - old)

    def _stop_probe(self) -> None:
        if self.probe is not None:
            self.policy.set_busy_mask(0)
            self.probe = None

    def step_events(self, now: float) -> float:
        """One decision in events mode; returns how long to sleep at most."""
        self._charge(now)
        active = self.active_slots()
        if self.lender is not None and (self.holder is None or not self.scheduler.binds(active)):
            self._set_lender(None)  # no turns any more: nothing to take back
        if not self.scheduler.binds(active):
            if self.holder is not None or self._mask != OPEN_MASK:
                self.holder = None
                self._set_mask(OPEN_MASK)
            self._stop_probe()
            self._set_beside(set(), now)
            self._set_duties(set())
            self.stats.binding = False
            return OPEN_POLL_S if self.procs else NO_TENANTS_POLL_S
        self.stats.binding = True
        if self.probe is not None:
            if self.probe.read_at == 0.0:  # running
                if now < self.probe.until:
                    return self.probe.until - now
                self._end_probe(now)
            elif now >= self.probe.read_at:
                self._read_probe(now)
        self._set_beside(self.scheduler.beside(active, self.busy_ratio, self.beside), now)
        self._set_duties(active)
        if self.beside and self.probe is None and now >= self._next_probe:
            self._start_probe(now)
            return PROBE_S
        contenders = active - self.beside
        wanting = self.wanting_slots() - self.beside
        if self.holder is None:
            if len(contenders) > 1:  # from the open gate: the contenders' queued work first
                self._drain(contenders)
                self._charge(time.monotonic())
            nxt = self.scheduler.pick(wanting or contenders, now)
            if nxt is not None:
                self._grant(nxt, now, wanting or contenders)
            elif self._mask == OPEN_MASK:
                self._set_mask(self._beside_bits())
            return self.slice_s
        if self._lend_or_reclaim(now, wanting):
            return self.slice_end - time.monotonic()
        holder = self.holder
        holder_wants = holder in wanting
        preempt = any(self.scheduler.preempts(holder, s, wanting) for s in wanting if s != holder)
        if holder_wants and now < self.slice_end and not preempt:
            return self.slice_end - now
        if not preempt and self._lend_claimed_turn(now, wanting):
            return self.slice_end - time.monotonic()
        others = wanting - {holder}
        if not others:
            if holder_wants:
                self._renew(now, wanting)  # nobody else waits
            return 0.1  # until then, a tenant that starts waiting rings the bell
        nxt = self.scheduler.pick(wanting if holder_wants else others, now, self._pending(now))
        if nxt == holder:
            self._renew(now, wanting)
            return self.slice_end - now
        if self.handover == Handover.DRAIN:
            self._drain({holder})
            self._charge(time.monotonic())
        self._grant(nxt, time.monotonic(), wanting)
        return self.slice_end - time.monotonic()

    def step_nvml(self, now: float) -> float:
        """One decision in nvml mode: token buckets on sampled utilization, every 100 ms."""
        dt = now - self._last_sample if self._last_sample else 0.1
        self._last_sample = now
        by_pid = self.utilization() if self.utilization else {}
        util: dict[int, float] = {}
        for pid, fraction in by_pid.items():
            state = self.procs.get(pid)
            if state is not None:
                util[state.view.slot] = util.get(state.view.slot, 0.0) + fraction
        self._nvml_samples += 1
        self._nvml_matched += bool(util)
        if self._nvml_samples == 50 and self.procs and not self._nvml_matched:
            self.log(f"gpuscope share: NVML gave no utilization for any tenant process in 5 s (pids seen: "
                     f"{sorted(by_pid)[:8]}, tenants: {sorted(self.procs)[:8]}): the buckets cannot bind")
        active = self.active_slots()
        self.stats.binding = len(active) > 1
        mask = self.buckets.update(util, active, dt)
        if mask != self._mask:
            self._set_mask(mask)
        return 0.1

    def _gate_state(self, slot: int) -> str:
        if self._mask == OPEN_MASK:
            return "open"
        if slot == self.holder:
            return "holder"
        return "beside" if slot in self.beside else "held"

    def _count_states(self, now: float, held_s: Sequence[float] | None = None) -> None:
        """Add the time since the last decision to each attached tenant's gate state (as decided then;
        ``held_s``: after the turn keeper, each slot's time as the holder, the rest held or beside)."""
        dt, self._last_state_count = now - self._last_state_count, now
        for slot in {s.view.slot for s in self.procs.values()}:
            name = self.tenants[slot].name
            if held_s is None:
                parts = {self._gate_state(slot): dt}
            else:
                holder_s = min(dt, held_s[slot])
                parts = {"holder": holder_s, "beside" if slot in self.beside else "held": dt - holder_s}
            for state, seconds in parts.items():
                self.stats.state_s[(name, state)] = self.stats.state_s.get((name, state), 0.0) + seconds

    # --- a new policy, live ------------------------------------------------------------------
    def apply_policy(self, spec: PolicySpec) -> None:
        """Take ``spec``'s tenants and admission rules, without a restart: tenants kept keep their
        slots and usage, new ones get new slots, removed ones keep theirs with share 0 (their running
        processes go on with what the others leave; new ones may not join). Raises ValueError,
        changing nothing, when the slots would run out."""
        with self.lock:
            wanted = {t.name: t for t in spec.tenants}
            kept = [wanted.get(t.name, TenantPolicy(t.name, 0.0)) for t in self.tenants]
            known = {t.name for t in self.tenants}
            tenants = kept + [t for t in spec.tenants if t.name not in known]
            if len(tenants) > MAX_TENANTS:
                raise ValueError(f"{len(tenants)} tenants with the removed ones still holding slots: at most "
                                 f"{MAX_TENANTS} until the controller restarts")
            shares_changed = [(t.share, t.priority) for t in tenants[:len(self.tenants)]] != \
                [(t.share, t.priority) for t in self.tenants]
            self.policy.set_tenants(tenants, Access(spec.allow))
            self.tenants = tenants
            self.scheduler.set_tenants(tenants)
            if shares_changed:
                # the usage remembered under the old shares would be repaid under the new ones (the
                # tenant whose share grew would take the whole GPU for a while): start afresh
                self.scheduler.used = [0.0] * len(tenants)
            self.buckets.set_tenants(tenants)
            for t in tenants:
                self.stats.slices.setdefault(t.name, 0)
                self.stats.charged_s.setdefault(t.name, 0.0)

    def _check_policy_file(self, now: float) -> None:
        due = self.reload_now or now - self._last_policy_check >= POLICY_CHECK_S
        if self.policy_file is None or not due:
            return
        self._last_policy_check, forced, self.reload_now = now, self.reload_now, False
        if not (forced or self.policy_file.changed()):
            return
        try:
            self.apply_policy(self.policy_file.read())
        except ValueError as exc:
            self.stats.policy_reloads["refused"] += 1
            self.log(f"gpuscope share: {self.policy_file.path} refused: {exc}; the policy in force stays")
            return
        self.stats.policy_reloads["applied"] += 1
        shares = ", ".join(f"{t.name}={t.share:g}" for t in self.tenants if t.share > 0)
        self.log(f"gpuscope share: {self.policy_file.path} applied: {shares}")

    def step(self) -> float:
        now = time.monotonic()
        self.policy.heartbeat()
        self._check_policy_file(now)
        self.adopt()
        self._count_states(now)
        if now - self._last_scan >= SCAN_S:
            # liveness of the known processes every time (kill(pid, 0)); reading /proc for zombies, a
            # process that exited but was not reaped (its connection ends only once reaped), now and then
            zombies = now - self._last_zombie_check >= ZOMBIE_CHECK_S
            self._last_scan = now
            if zombies:
                self._last_zombie_check = now
            self.scan(zombie_check=zombies)
        with self.lock:
            if self.mode == Accounting.NVML:
                return self.step_nvml(now)
            return self.step_events(now)

    def keeps_turns(self) -> bool:
        """Whether the next hand-overs can run in C: tenants take turns (a holder, no probe running)."""
        return self.keeper and self.stats.binding and self.holder is not None and self.probe is None

    def keep_turns(self, seen: int) -> float:
        """Hand over between slice holders in C until the next bookkeeping (at most
        ``KEEPER_RETURN_S``, or the next probe), or until a tenant rings the bell (``seen``: the bell's
        value before the last step). Returns how long to sleep on the bell afterwards."""
        now = time.monotonic()
        until = now + KEEPER_RETURN_S
        if self.beside:
            until = min(until, self._next_probe)
        with self.lock:
            procs = tuple((state.view.slot, pid, state.view.address) for pid, state in self.procs.items())
            used = self.scheduler.usage(now, self._pending(now))
        policy = self.policy
        out = _turns.take_turns(
            gate=policy.gate_address, bell=policy.bell_address, heartbeat=policy.heartbeat_address,
            bell_seen=seen, gen=policy.gen, beside=self._beside_bits(), holder=self.holder,
            slice_start_ns=int(self._slice_start * 1e9), slice_end_ns=int(self.slice_end * 1e9),
            return_ns=int(until * 1e9), base_slice_ns=int(self.slice_s * 1e9),
            recent_ns=int(HOLDER_RECENT_S * 1e9),
            drain_timeout_ns=int(self.drain_timeout_s * 1e9) if self.handover == Handover.DRAIN else 0,
            slice_end_word=policy.slice_end_address,
            grace_ns=int(YIELD_GRACE_WINDOWS * policy.window_us * 1e3),
            shares=[t.share for t in self.tenants], priorities=[t.priority for t in self.tenants], used=used,
            procs=procs, offsets=KEEPER_OFFSETS, lender_word=policy.lender_mask_address,
            lender=-1 if self.lender is None else self.lender, lend_end_ns=int(self.lend_end * 1e9))
        with self.lock:
            policy.gen = out["gen"]
            self.stats.drain_timeouts += out["drain_timeouts"]
            self.stats.yields += out["yields"]
            self.stats.lends += out["lends"]
            self.stats.reclaims += out["reclaims"]
            lender = out["lender"]
            self.lender, self.lend_end = (None, 0.0) if lender < 0 else (lender, out["lend_end_ns"] / 1e9)
            if out["holder"] != self.holder:
                self.holder, self._mask = out["holder"], (1 << out["holder"]) | self._beside_bits()
            if any(out["grants"]):
                self._slice_start, self._posted_in_slice = out["slice_start_ns"] / 1e9, 0.0
            self.slice_end = out["slice_end_ns"] / 1e9
            for slot, count in enumerate(out["grants"]):
                self.stats.slices[self.tenants[slot].name] += count
            self._count_states(time.monotonic(), [ns / 1e9 for ns in out["held_ns"]])
        reason = out["reason"]
        if reason == _turns.RETURN_GONE:
            self._last_scan = 0.0  # a tenant process exited: the next step forgets it
        # the holder went quiet with nobody waiting: as the Python loop would, wait for a bell
        return 0.1 if reason == _turns.RETURN_IDLE else 0.0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            seen = self.policy.bell_value()
            timeout = self.step()
            if self.keeps_turns():
                timeout = self.keep_turns(seen)
                if timeout <= 0:
                    continue
            self.policy.wait_bell(seen, max(0.0005, min(timeout, NO_TENANTS_POLL_S)))

    def close(self) -> None:
        with self.lock:
            for pid in list(self.procs):
                self.procs.pop(pid).view.close()
        self.policy.close()
