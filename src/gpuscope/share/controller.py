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
from gpuscope.share.charging import Charger
from gpuscope.share.gangs import Gangs, GangView
from gpuscope.share.gpus import NO_INDEX, Gpu
from gpuscope.share.ledger import (
    KEEPER_OFFSETS,
    MAX_TENANTS,
    OPEN_MASK,
    LedgerFiles,
    Policy,
    TenantPolicy,
    pid_alive,
)
from gpuscope.share.policy import PolicyFile, PolicySpec
from gpuscope.share.probes import Prober
from gpuscope.share.processes import HOLDER_RECENT_S, ProcessTable
from gpuscope.share.scheduler import SliceScheduler, TokenBuckets, beside_fraction
from gpuscope.share.settings import (
    HOLD_CREDIT_S,
    HOLD_MAX_S,
    KEEPER_RETURN_S,
    STARVED_TURNS_S,
    Accounting,
    Handover,
    LoneHolder,
    PriorityHold,
    ShareSettings,
    Turns,
)

try:
    from gpuscope.share import _turns
except ImportError:  # no compiler where gpuscope was installed: the Python loop hands over (more CPU)
    _turns = None

#: The settings of a controller made without any (the command's defaults).
DEFAULTS = ShareSettings()

#: How often the controller checks that its tenant processes live (a dead one's share is given back),
#: and how often it also reads /proc to tell a zombie (exited, not yet reaped by its parent).
SCAN_S, ZOMBIE_CHECK_S = 0.1, 2.0
#: How often the loop looks while shares do not bind: with tenant processes attached (the gate is
#: open, so a second one starting to launch rings nothing: this is how long it may run unshared
#: before shares bind), and with none (a process that joins rings the bell; the heartbeat must still
#: move well inside the tenants' 2 s staleness limit).
OPEN_POLL_S, NO_TENANTS_POLL_S = 0.25, 0.5
#: How often it looks while every active tenant runs beside the holder (nobody takes turns): a tenant
#: that must take turns is held at the gate and rings, so only the next probe is waited for. Looking
#: more often costs CPU for nothing: at 0.25 s, with three tenants beside one another on the CPU
#: host's fake GPU, 0.33-0.35% of a core against 0.23-0.26% at 0.5 s
#: (``results/share-controller-cpu-half-second.json``).
BESIDE_POLL_S = 0.5
#: A holder that goes quiet (nothing queued, no launch) with more than this left of its turn while
#: others wait lends them the rest of it and keeps its claim: its next launch takes the turn back
#: (a training step's host work between its kernels would otherwise cost it the whole turn).
LEND_MIN_S = 0.001
#: With draining hand-overs the holder stops at its slice's end by itself (it sees the end in the
#: policy), drains its queue and rings: one wake-up of the keeper per hand-over instead of two. The
#: keeper waits this many accounting windows past the end for that before it drains the holder itself
#: (the yield comes at its next launch, and the queue holds two windows).
YIELD_GRACE_WINDOWS = 4

#: A tenant beside the holder is judged starved (``SliceScheduler.starved``, ``--share.starved-below``)
#: on its waits for the GPU over at least this long there, and at most twice it: a training step's
#: waits come in steps of tens of ms, and a window much shorter would judge a few of them.
STARVED_JUDGE_S = 2.0
#: The lone holder's throughput (its launches a second against its probes') is read over this long
#: for its duty (``SliceScheduler.lone_holder_duty``): a GPU-bound step lasts milliseconds.
LONE_JUDGE_S = 1.0
#: Taking turns, such a tenant is charged its kernel time over its probed busy fraction (its holding
#: time, running as it does alone), its busy fraction taken as at least this (probes read low for a
#: tenant that waited for work during its probe).
MIN_HOLDING_BUSY = 0.1

#: How often the policy file (--share.policy-file) is looked at for a change (a stat() call): a change
#: is applied within this, and the turn keeper takes it at its next return (KEEPER_RETURN_S).
POLICY_CHECK_S = 0.5
#: A GPU that follows a gang tenant's turns on another GPU (gangs.py) looks at least this often; the
#: other GPU's controller rings it at each change anyway.
GANG_FOLLOW_S = 0.05

UtilizationSource = Callable[[], Mapping[int, float]]  # pid -> fraction of the GPU, last 100 ms


@dataclass
class Stats:
    """What /metrics shows besides the processes' own counters."""

    slices: dict[str, int] = field(default_factory=dict)
    charged_s: dict[str, float] = field(default_factory=dict)  # GPU seconds charged, after correction
    drain_timeouts: int = 0
    yields: int = 0  # draining hand-overs where the holder yielded at its slice's end by itself
    lends: int = 0  # quiet holders that lent the rest of their turn
    reclaims: int = 0  # lent turns taken back by their lender before they ended
    priority_holds: int = 0  # bursts of a tenant of higher priority that held the holder's launches
    priority_hold_s: float = 0.0
    probes: int = 0
    starved: dict[str, int] = field(default_factory=dict)  # tenant -> moves from beside to turns
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
    busy_ratio: dict[str, float]  # tenant -> busy fraction of its probes (running alone)
    duty: dict[str, float]  # tenant beside the holder (or the lone holder under a duty) -> its duty
    beside_throughput: dict[str, float]  # tenant beside the holder -> its estimated fraction of alone
    joins: dict[str, int]
    memory: tuple[tuple[str, int, int, int], ...]  # tenant, bytes held, refusals, cap in bytes (0: none)


class Controller:
    """The loop that decides who may launch: it holds the ledger (``policy``), the joined processes
    (``processes``), the charges (``charger``), the probes of each tenant's busy fraction (``prober``)
    and the scheduler, and hands turns over itself or through the turn keeper in C."""

    def __init__(self, prefix: str, tenants: list[TenantPolicy], settings: ShareSettings = DEFAULTS, *,
                 utilization: UtilizationSource | None = None, access: Access | None = None,
                 log: Callable[[str], None] | None = None, policy_file: PolicyFile | None = None,
                 files: LedgerFiles | None = None, gpu: Gpu | None = None) -> None:
        """``settings``: the command's flags as they are (``--share.slice``, ``--share.handover``...);
        ``tenants``, ``access`` and ``policy_file`` replace its ``--share`` and ``--share.allow``.
        ``gpu``: the GPU this controller holds, one of a node's (``node.py``, which shares its
        ``files``, the lock and join socket, between them); none: the one GPU of the ledger."""
        self.log = log or (lambda line: sys.stderr.write(line + "\n"))
        self.settings = settings
        first = settings.gpus[0] if isinstance(settings.gpus, tuple) else 0
        self.gpu = gpu or (Gpu(first) if isinstance(first, int) else Gpu(NO_INDEX, first))
        # hand-overs between slice holders in C (nvml mode has none: it stays in Python)
        self.keeper = (settings.turns == Turns.C and _turns is not None
                       and settings.accounting == Accounting.EVENTS)
        # bursts of a tenant of higher priority hold the slice holder (in the turn keeper only)
        self.priority_hold = self.keeper and settings.priority_hold == PriorityHold.ON
        self.policy = Policy(prefix, tenants, mode=str(settings.accounting),
                             window_us=int(settings.window * 1e6), inflight_slice=settings.queued_windows,
                             beside_queue_us=int(settings.beside_queue * 1e6),
                             priority_hold=self.priority_hold,
                             access=access, log=self.log, files=files, uuid=self.gpu.uuid_bytes)
        self.tenants = tenants
        self.mode = settings.accounting
        self.slice_s = settings.slice
        self.drain_timeout_s = settings.drain_timeout
        self.handover = settings.handover
        self._hold_credit_ns = int(HOLD_CREDIT_S * 1e9)
        self.scheduler = SliceScheduler(tenants, starved_below=settings.starved_below)
        self.buckets = TokenBuckets(tenants)
        self.utilization = utilization
        self.holder: int | None = None  # None: the gate is open
        self.lender: int | None = None  # the tenant whose turn the holder runs in (it lent the rest)
        self.lend_end = 0.0
        self.slice_end = 0.0
        self.stats = Stats(slices={t.name: 0 for t in tenants}, charged_s={t.name: 0.0 for t in tenants})
        self.beside: set[int] = set()  # slots running beside the holder (SliceScheduler.beside)
        self.duty: dict[int, float] = {}  # slot -> part of the time it may launch, beside (below 1: over)
        #: slot beside -> (since, its waits' ns then, its launches then)
        self._wait_mark: dict[int, tuple[float, int, int]] = {}
        self.to_turns: dict[int, float] = {}  # slot found starved beside the holder -> taking turns until
        self.beside_throughput: dict[int, float] = {}  # slot beside -> its fraction of alone, estimated
        #: the lone holder under a duty: (slot, since, its launches then), and its throughput lately
        self._lone_mark: tuple[int, float, int] | None = None
        self.lone_throughput: float | None = None
        self.lock = threading.Lock()  # /metrics reads the processes while the loop changes them
        self.processes = ProcessTable(self.policy, self.lock, lambda slot: self.tenants[slot].name,
                                      self.stats.departed)
        self._last_state_count = time.monotonic()
        self.charger = Charger(self.processes, self.scheduler, self.stats.charged_s, self._last_state_count)
        self.prober = Prober(self.policy, self.processes, settings.probe_every, settings.probe_backoff)
        self._last_scan = self._last_zombie_check = 0.0
        self.policy_file = policy_file
        self._last_policy_check = time.monotonic()
        self.reload_now = False  # set by SIGHUP: look at the policy file at the next step
        self._last_sample = 0.0
        self._mask = OPEN_MASK
        self._nvml_samples = self._nvml_matched = 0
        #: the node's gang tenants (gangs.py), where it has any: set by the node
        self.gangs: Gangs | None = None
        #: this GPU's gang tenants with processes attached, active and wanting, as its last step saw
        #: them (read by the other GPUs' loops: replaced whole, never changed in place)
        self.gang_view = GangView()

    # --- processes --------------------------------------------------------------------------
    @property
    def procs(self) -> dict:
        """The joined processes by pid (``processes.procs``)."""
        return self.processes.procs

    def joined_pids(self) -> list[int]:
        return self.processes.joined_pids()

    def tenants_by_pid(self) -> dict[int, str]:
        return self.processes.tenants_by_pid()

    def snapshot(self) -> Snapshot:
        """A consistent copy of what the metrics show, taken under the lock."""
        with self.lock:
            names = [t.name for t in self.tenants]
            return Snapshot(
                tenants=tuple(self.tenants),
                processes=tuple((names[s.view.slot], pid, {**s.view.counters(), "waiting": s.view.waiting})
                                for pid, s in self.processes.procs.items()),
                stats=copy.deepcopy(self.stats),
                busy_ratio={names[slot]: r for slot, r in self.prober.busy_ratio.items()},
                duty={names[slot]: self.duty.get(slot, 1.0)
                      for slot in self.beside | {s for s, d in self.duty.items() if d < 1.0}},
                beside_throughput={names[slot]: r for slot, r in self.beside_throughput.items()},
                joins=dict(self.policy.joins.results),
                memory=tuple((t.name, page.used, page.refused, self.policy.mem_cap_bytes(slot))
                             for slot, (t, page) in enumerate(zip(self.tenants, self.policy.memory,
                                                                  strict=True))))

    def charged_seconds(self) -> dict[str, float]:
        with self.lock:
            return dict(self.stats.charged_s)

    def _charge(self, now: float) -> None:
        """Charge what the processes posted since the last call (``Charger.charge``)."""
        launch_s = self.prober.launch_s
        # several tenants at once: the open gate, tenants beside the holder, or (overlap hand-overs) the
        # previous holder's queued work running beside the next one's
        concurrent = (bin(self._mask & OPEN_MASK).count("1") > 1
                      or (self.handover == Handover.OVERLAP and self._mask != OPEN_MASK))
        # a tenant taking turns because it was starved beside the holder syncs at every short step and
        # holds the GPU idle between them, too briefly to lend: charged its kernels alone it would get
        # turns until they made its share, and the others less than theirs (docs/share.md, Limits)
        busy = self.prober.busy_ratio
        holding = {slot: 1.0 / max(busy[slot], MIN_HOLDING_BUSY) for slot in self.to_turns if slot in busy}
        self.charger.charge(now, holder=self.holder, concurrent=concurrent, gate_open=self._mask == OPEN_MASK,
                            beside_launch_s={slot: launch_s.get(slot, 0.0) for slot in self.beside},
                            holding_scale=holding)

    def _pending(self, now: float) -> dict[int, float]:
        return self.charger.pending(now, self.holder)

    # --- the gate ---------------------------------------------------------------------------
    def _set_mask(self, mask: int) -> int:
        self._mask = mask
        gen = self.policy.set_gate(mask)
        if self.gangs is not None:
            self.gangs.gate_changed(self)  # the GPUs that follow a gang's turns here look now
        return gen

    def _lone_holder(self, active: set[int]) -> int | None:
        """The one active tenant taking turns while every other runs beside it, where
        ``--share.lone-holder duty`` holds it by a duty (not a gang's, nor one moved to turns because
        it was starved beside the holder)."""
        if self.settings.lone_holder != LoneHolder.DUTY or not self.beside & active:
            return None
        contenders = active - self.beside
        if len(contenders) != 1 or contenders & (set(self.gang_slots()) | set(self.to_turns)):
            return None
        return next(iter(contenders))

    def _set_duties(self, active: set[int]) -> None:
        """Hold each tenant beside the holder to its share by its duty (``SliceScheduler.duty``), while
        the active tenants' summed demand is more than the GPU; and the lone holder, where
        ``--share.lone-holder duty`` says so, to the time the others leave
        (``SliceScheduler.lone_holder_duty``)."""
        busy = self.prober.busy_ratio
        demand = {slot: busy[slot] for slot in active if slot in busy}
        # each tenant's charged GPU seconds decay over the scheduler's memory: over it, a rate
        used = self.scheduler.usage(time.monotonic())
        lone = self._lone_holder(active)
        if lone is None:
            self._lone_mark = self.lone_throughput = None
        for slot in range(len(self.tenants)):
            if slot in self.beside:
                duty = self.scheduler.duty(slot, active, busy.get(slot), demand,
                                           rate=used[slot] / self.scheduler.memory_s,
                                           current=self.duty.get(slot, 1.0))
            elif slot == lone:
                duty = self._lone_holder_duty(slot, active, busy)
            else:
                duty = 1.0
            if duty != self.duty.get(slot, 1.0):
                self.policy.set_duty(slot, duty)
                self.duty[slot] = duty

    def _lone_holder_duty(self, slot: int, active: set[int], busy: dict[int, float]) -> float:
        """The lone holder's duty (``SliceScheduler.lone_holder_duty``), from its throughput over each
        ``LONE_JUDGE_S`` (its launches a second against its probes'); between two readings it stays."""
        now = time.monotonic()
        launches = self.processes.launches(slot)
        current = self.duty.get(slot, 1.0)
        if self._lone_mark is None or self._lone_mark[0] != slot:
            self._lone_mark, self.lone_throughput = (slot, now, launches), None
        elif now - self._lone_mark[1] >= LONE_JUDGE_S:
            # its launches a second alone, from its probes' timed part (its busy fraction over its
            # kernel time a launch): the lead's rate, read just after a pause, reads low
            per_launch = self.prober.launch_s.get(slot)
            if per_launch and busy.get(slot):
                rate = (launches - self._lone_mark[2]) / (now - self._lone_mark[1])
                self.lone_throughput = rate * per_launch / busy[slot]
            self._lone_mark = (slot, now, launches)
        elif current < 1.0:
            return current  # judged once a second, on a second under one duty
        return self.scheduler.lone_holder_duty(slot, self.beside & active, busy, self.lone_throughput,
                                               current)

    def _estimate_beside_throughput(self, now: float) -> None:
        """Each tenant beside the holder's throughput as a fraction of its alone rate
        (``scheduler.beside_fraction``: the part of its time it waited for the GPU there, and its
        launches a second, over a window of ``STARVED_JUDGE_S`` to twice that, against the same in its
        probes), once it has been beside that long."""
        for slot in self.beside:
            since, waited_ns, launched = self._wait_mark.get(slot, (now, 0, 0))
            if now - since < STARVED_JUDGE_S or slot not in self.prober.wait_ratio:
                continue
            total_ns, launches = self.processes.sync_wait_ns(slot, now), self.processes.launches(slot)
            waiting = max(0, total_ns - waited_ns) / 1e9 / (now - since)
            alone_rate = self.prober.launch_rate.get(slot)
            launch_ratio = (max(0, launches - launched) / (now - since) / alone_rate
                            if alone_rate else None)
            estimate = beside_fraction(self.prober.wait_ratio[slot], waiting, launch_ratio)
            if estimate is not None:
                self.beside_throughput[slot] = estimate
            if now - since >= 2 * STARVED_JUDGE_S:  # the next window starts
                self._wait_mark[slot] = (now, total_ns, launches)

    def _move_starved(self, active: set[int], now: float) -> set[int]:
        """The tenants that take turns whatever their probes say: those found ``starved`` beside the
        holder (``SliceScheduler.starved``) within ``STARVED_TURNS_S``. A tenant is judged on its
        estimated throughput there (``_estimate_beside_throughput``) while no duty holds it back, and
        only while another tenant takes turns: it is the holder's queue and time-slice its steps wait
        behind."""
        self.to_turns = {s: until for s, until in self.to_turns.items() if until > now and s in active}
        self._estimate_beside_throughput(now)
        if not active - self.beside:
            return set(self.to_turns)
        for slot in self.beside & active:
            if (self.duty.get(slot, 1.0) == 1.0
                    and self.scheduler.starved(slot, active, self.beside_throughput.get(slot))):
                self.to_turns[slot] = now + STARVED_TURNS_S
                name = self.tenants[slot].name
                self.stats.starved[name] = self.stats.starved.get(name, 0) + 1
        return set(self.to_turns)

    def _beside_bits(self) -> int:
        return sum(1 << s for s in self.beside)

    def _set_beside(self, beside: set[int], now: float) -> None:
        """Let ``beside`` run next to the holder (untimed, drained only for another tenant's probe); the
        gate follows."""
        if beside == self.beside:
            return
        self._wait_mark = {s: self._wait_mark.get(s) or (now, self.processes.sync_wait_ns(s, now),
                                                          self.processes.launches(s)) for s in beside}
        self.beside_throughput = {s: r for s, r in self.beside_throughput.items() if s in beside}
        self.beside = beside
        self.policy.set_beside_mask(self._beside_bits())
        if self.holder in beside:
            self.holder = None  # it keeps running, now beside: the contenders pick a holder anew
        if self._mask != OPEN_MASK:
            self._set_mask(self._beside_bits() | (1 << self.holder if self.holder is not None else 0))

    def _set_lender(self, slot: int | None, end: float = 0.0) -> None:
        self.lender, self.lend_end = slot, end
        self.policy.set_lender_mask(0 if slot is None else 1 << slot)

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
        if not self.processes.quiet(holder) or not others or self.slice_end - now < LEND_MIN_S:
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

    def _drain(self, slots: set[int], running: int | None = None) -> None:
        """Close the gate to ``slots`` and wait until their processes have nothing queued (the
        tenants beside the holder keep running, or those in the mask ``running``)."""
        gen = self._set_mask(self._beside_bits() if running is None else running)
        for state in self.processes:
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
        self.charger.start_slice(now)
        self.slice_end = now + self.scheduler.quantum(self.holder, wanting | {self.holder}, self.slice_s)
        self.stats.slices[self.tenants[self.holder].name] += 1

    # --- probes: how busy each tenant keeps the GPU, running alone --------------------------------
    def _start_probe(self, slot: int) -> float:
        """Pause every other tenant, its queued work drained first, except those beside the holder of
        higher priority than ``slot``, and probe ``slot`` (``Prober``: a lead as it launches anyway,
        then each launch timed); returns how long its lead lasts. A tenant beside the holder is
        drained too: it launches untimed, so its process waits for an event after its last launch when
        its gate closes. Not drained, a training step's kernels queued beside ran through the first
        milliseconds of another tenant's probe, and were timed as that tenant's busy time."""
        keep = {s for s in self.beside if self.tenants[s].priority > self.tenants[slot].priority}
        running = sum(1 << s for s in keep | {slot})
        self._drain(set(range(len(self.tenants))) - keep - set(self.gang_slots()) - {slot}, running)
        self.holder = None
        self.stats.probes += 1
        return self.prober.start(slot, time.monotonic())

    # --- gang tenants: one turn on all their GPUs at once (gangs.py) --------------------------
    def gang_slots(self) -> dict[int, str]:
        """This GPU's gang tenants with processes attached, by slot."""
        if self.gangs is None:
            return {}
        attached = self.processes.attached_slots()
        return {slot: t.name for slot, t in enumerate(self.tenants) if t.gang and slot in attached}

    def _gang_union(self, gangs: dict[int, str], active: set[int]) -> set[int]:
        """Publish what this GPU sees of its gang tenants, and count each as active here while any of
        its ranks is active on another GPU (the group contends as one)."""
        wanting = self.processes.wanting_slots(self.holder)
        view = GangView(frozenset(gangs.values()), frozenset(n for s, n in gangs.items() if s in active),
                        frozenset(n for s, n in gangs.items() if s in wanting))
        active = active | {s for s, n in gangs.items() if self.gangs.active_elsewhere(n, self)}
        view = view.binding_is(self.scheduler.binds(active))
        if view != self.gang_view:
            self.gang_view = view
            self.gangs.view_changed(self)
        return active

    def _follow_gangs(self, gangs: dict[int, str], wanting: set[int]) -> tuple[set[int], float | None]:
        """On a GPU that is not a gang's lead, the gang holds this GPU exactly while it holds its lead
        (its turns are decided there): granted at once (the holder drained first), taken back without a
        drain (a collective cut by the turn's end finishes beside the next holder, at the group's next
        turn). Returns the slots that wait for their lead, and how long to sleep when a gang holds."""
        followed = {s for s, n in gangs.items() if self.gangs.lead(n) not in (None, self)}
        if not followed:
            return set(), None
        on = [s for s in sorted(followed) if self.gangs.holds(gangs[s])]
        if on:
            slot = on[0]  # two gangs held on their leads at once: one holds here, the other waits
            if self.holder != slot:
                if self.holder is not None and self.holder not in gangs and self.handover == Handover.DRAIN:
                    self._drain({self.holder})
                    self._charge(time.monotonic())
                self._set_lender(None)
                self._grant(slot, time.monotonic(), wanting | {slot})
            return set(followed) - {slot}, GANG_FOLLOW_S
        if self.holder in followed:
            self.holder = None
            self._set_lender(None)
            self._set_mask(self._beside_bits())
        return followed, None

    def step_events(self, now: float) -> float:
        """One decision in events mode; returns how long to sleep at most."""
        self._charge(now)
        active = self.processes.active_slots()
        gangs = self.gang_slots()
        if self.gangs is not None:
            active = self._gang_union(gangs, active)
        if self.lender is not None and (self.holder is None or not self.scheduler.binds(active)):
            self._set_lender(None)  # no turns any more: nothing to take back
        if not self.scheduler.binds(active):
            self.policy.set_turns_mask(0)
            if self.holder is not None or self._mask != OPEN_MASK:
                self.holder = None
                self._set_mask(OPEN_MASK)
            self.prober.stop()
            self.to_turns.clear()
            self.beside_throughput.clear()
            self._set_beside(set(), now)
            self._set_duties(set())
            self.stats.binding = False
            return OPEN_POLL_S if len(self.processes) else NO_TENANTS_POLL_S
        self.stats.binding = True
        probe_left = self.prober.advance(now)
        if probe_left is not None:
            return probe_left
        # a gang never runs beside a holder, nor is probed: its ranks on other GPUs could not follow
        to_turns = self._move_starved(active, now)
        beside = self.scheduler.beside(active, self.prober.busy_ratio, self.beside, to_turns)
        self._set_beside(beside - set(gangs), now)
        self._set_duties(active)
        probed = self.prober.due(now, active - set(gangs))
        if probed is not None:
            return self._start_probe(probed)
        contenders = active - self.beside
        wanting = self.processes.wanting_slots(self.holder) - self.beside
        if gangs:
            wanting |= {s for s, n in gangs.items() if self.gangs.wanting_elsewhere(n, self)}
            waiting_for_lead, follow_s = self._follow_gangs(gangs, wanting)
            if follow_s is not None:
                return follow_s
            contenders -= waiting_for_lead
            wanting -= waiting_for_lead
        self.policy.set_turns_mask(sum(1 << s for s in contenders))
        if self.holder is None:
            if len(contenders) > 1:  # from the open gate: the contenders' queued work first
                self._drain(contenders - set(gangs))  # a gang's collectives may wait on its other GPUs
                self._charge(time.monotonic())
            nxt = self.scheduler.pick(wanting or contenders, now)
            if nxt is not None:
                self._grant(nxt, now, wanting or contenders)
                return self.slice_s
            if self._mask != self._beside_bits():
                self._set_mask(self._beside_bits())
            # every active tenant runs beside (none takes turns): nothing to decide until the next
            # probe, or until a tenant held at the gate rings (nobody holds it)
            return max(0.0, min(BESIDE_POLL_S, self.prober.next_probe(active - set(gangs), now) - now))
        # a gang's turns are not lent: its ranks on the other GPUs hold theirs meanwhile
        lends = self.holder not in gangs and self.lender not in gangs
        if lends and self._lend_or_reclaim(now, wanting):
            return self.slice_end - time.monotonic()
        holder = self.holder
        holder_wants = holder in wanting
        preempt = any(self.scheduler.preempts(holder, s, wanting) for s in wanting if s != holder)
        if holder_wants and now < self.slice_end and not preempt:
            return self.slice_end - now
        if not preempt and lends and self._lend_claimed_turn(now, wanting):
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
        # a gang is not drained: a collective it queued may wait for a rank its other GPUs now hold,
        # and finishes beside the next holder instead of stalling this GPU for a drain timeout
        if self.handover == Handover.DRAIN and holder not in gangs:
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
            slot = self.processes.slot_of(pid)
            if slot is not None:
                util[slot] = util.get(slot, 0.0) + fraction
        self._nvml_samples += 1
        self._nvml_matched += bool(util)
        if self._nvml_samples == 50 and len(self.processes) and not self._nvml_matched:
            self.log(f"gpuscope share: NVML gave no utilization for any tenant process in 5 s (pids seen: "
                     f"{sorted(by_pid)[:8]}, tenants: {sorted(self.processes.procs)[:8]}): "
                     "the buckets cannot bind")
        active = self.processes.active_slots()
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
        for slot in self.processes.attached_slots():
            name = self.tenants[slot].name
            if held_s is None:
                parts = {self._gate_state(slot): dt}
            else:
                holder_s = min(dt, held_s[slot])
                parts = {"holder": holder_s, "beside" if slot in self.beside else "held": dt - holder_s}
            for state, seconds in parts.items():
                self.stats.state_s[(name, state)] = self.stats.state_s.get((name, state), 0.0) + seconds

    # --- a new policy, live ------------------------------------------------------------------
    def merged_tenants(self, spec: PolicySpec) -> list[TenantPolicy]:
        """The slots ``spec`` makes of the ones in force (``apply_policy``); ValueError when the slots
        would run out."""
        wanted = {t.name: t for t in spec.tenants}
        kept = [wanted.get(t.name, TenantPolicy(t.name, 0.0)) for t in self.tenants]
        known = {t.name for t in self.tenants}
        tenants = kept + [t for t in spec.tenants if t.name not in known]
        if len(tenants) > MAX_TENANTS:
            raise ValueError(f"{len(tenants)} tenants with the removed ones still holding slots: at most "
                             f"{MAX_TENANTS} until the controller restarts")
        return tenants

    def apply_policy(self, spec: PolicySpec) -> None:
        """Take ``spec``'s tenants and admission rules, without a restart: tenants kept keep their
        slots and usage, new ones get new slots, removed ones keep theirs with share 0 (their running
        processes go on with what the others leave; new ones may not join). Raises ValueError,
        changing nothing, when the slots would run out."""
        with self.lock:
            tenants = self.merged_tenants(spec)
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
        self.processes.adopt()
        self._count_states(now)
        if now - self._last_scan >= SCAN_S:
            # liveness of the known processes every time (kill(pid, 0)); reading /proc for zombies, a
            # process that exited but was not reaped (its connection ends only once reaped), now and then
            zombies = now - self._last_zombie_check >= ZOMBIE_CHECK_S
            self._last_scan = now
            if zombies:
                self._last_zombie_check = now
            self.processes.scan(zombie_check=zombies)
        with self.lock:
            if self.mode == Accounting.NVML:
                return self.step_nvml(now)
            return self.step_events(now)

    def keeps_turns(self) -> bool:
        """Whether the next hand-overs can run in C: tenants take turns (a holder, no probe running)."""
        # the keeper steps aside while a gang tenant has processes here: its turns follow other GPUs
        return (self.keeper and self.stats.binding and self.holder is not None and self.prober.probe is None
                and not self.gang_slots())

    def _hold_rate(self) -> float:
        """The part of the time bursts may hold the holder (``--share.priority-hold``): the shares of the
        tenants beside it of higher priority than its own."""
        mine = self.tenants[self.holder].priority
        return min(1.0, sum(self.tenants[s].share for s in self.beside if self.tenants[s].priority > mine))

    def keep_turns(self, seen: int) -> float:
        """Hand over between slice holders in C until the next bookkeeping (at most
        ``KEEPER_RETURN_S``, or the next probe), or until a tenant rings the bell (``seen``: the bell's
        value before the last step). Returns how long to sleep on the bell afterwards."""
        now = time.monotonic()
        with self.lock:
            candidates = self.processes.active_slots() - set(self.gang_slots())
            until = min(now + KEEPER_RETURN_S, self.prober.next_probe(candidates, now))
            procs = self.processes.keeper_view()
            used = self.scheduler.usage(now, self._pending(now))
            hold_rate = self._hold_rate()
        policy = self.policy
        out = _turns.take_turns(
            gate=policy.gate_address, bell=policy.bell_address, heartbeat=policy.heartbeat_address,
            bell_seen=seen, gen=policy.gen, beside=self._beside_bits(), holder=self.holder,
            slice_start_ns=int(self.charger.slice_start * 1e9), slice_end_ns=int(self.slice_end * 1e9),
            return_ns=int(until * 1e9), base_slice_ns=int(self.slice_s * 1e9),
            recent_ns=int(HOLDER_RECENT_S * 1e9),
            drain_timeout_ns=int(self.drain_timeout_s * 1e9) if self.handover == Handover.DRAIN else 0,
            slice_end_word=policy.slice_end_address,
            grace_ns=int(YIELD_GRACE_WINDOWS * policy.window_us * 1e3),
            shares=[t.share for t in self.tenants], priorities=[t.priority for t in self.tenants], used=used,
            procs=procs, offsets=KEEPER_OFFSETS, lender_word=policy.lender_mask_address,
            lender=-1 if self.lender is None else self.lender, lend_end_ns=int(self.lend_end * 1e9),
            hold_word=policy.hold_mask_address if self.priority_hold else 0,
            hold_max_ns=int(HOLD_MAX_S * 1e9), hold_rate=hold_rate, hold_credit_ns=self._hold_credit_ns,
            hold_credit_cap_ns=int(HOLD_CREDIT_S * 1e9))
        with self.lock:
            self._hold_credit_ns = out["hold_credit_ns"]
            self.stats.priority_holds += out["holds"]
            self.stats.priority_hold_s += out["hold_ns"] / 1e9
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
                self.charger.start_slice(out["slice_start_ns"] / 1e9)
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
        self.processes.close()
        self.policy.close()
