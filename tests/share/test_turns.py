"""The controller's turn keeper (``_turns.take_turns``): hand-overs between slice holders in C, checked
against a real ledger page and process pages laid out as the preload library writes them."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import pytest

from gpuscope.share.ledger import (
    KEEPER_OFFSETS,
    OPEN_MASK,
    P_HEARTBEAT,
    QUIET_NS,
    SYS_FUTEX,
    Policy,
    TenantPolicy,
    _libc,
    _Timespec,
)
from gpuscope.share.scheduler import SliceScheduler

_turns = pytest.importorskip("gpuscope.share._turns", reason="the turn keeper was not built (no C compiler)")

WAITING, WINDOW_OPEN, INFLIGHT, LAST_LAUNCH, DRAINED, BURST = KEEPER_OFFSETS


class Page:
    """A tenant process's page: the words the keeper reads to tell who wants the GPU."""

    def __init__(self, slot: int, pid: int | None = None) -> None:
        self.buf = ctypes.create_string_buffer(4096)
        self.slot, self.pid = slot, pid if pid is not None else os.getpid()

    def set(self, *, waiting: int = 0, window_open: int = 0, inflight: int = 0, last_launch_ns: int = 0,
            burst_ns: int = 0):
        base = ctypes.addressof(self.buf)
        ctypes.c_uint32.from_address(base + WAITING).value = waiting
        for off, value in ((WINDOW_OPEN, window_open), (INFLIGHT, inflight), (LAST_LAUNCH, last_launch_ns),
                           (BURST, burst_ns)):
            ctypes.c_uint64.from_address(base + off).value = value
        return self

    @property
    def entry(self) -> tuple[int, int, int]:
        return (self.slot, self.pid, ctypes.addressof(self.buf))


@pytest.fixture
def tenants():
    return [TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)]


@pytest.fixture
def policy(tmp_path, tenants):
    p = Policy(str(tmp_path / "ledger"), tenants)
    yield p
    p.close()


class Turns(NamedTuple):
    """What take_turns returns."""

    reason: int
    holder: int
    gen: int
    start: int
    end: int
    grants: tuple
    held: tuple
    timeouts: int
    yields: int
    lender: int
    lend_end: int
    lends: int
    reclaims: int
    holds: int
    hold_ns: int
    hold_credit_ns: int


def keep(policy: Policy, tenants, pages, *, holder: int = 0, slice_end_s: float = 0.0, return_s: float = 0.05,
         base_slice_s: float = 0.01, used=None, beside: int = 0, bell_seen: int | None = None,
         drain_timeout_s: float = 0.0, grace_s: float = 0.0, lender: int = -1, lend_end_ns: int = 0,
         hold: bool = False, hold_max_s: float = 0.02, hold_rate: float = 0.3, hold_credit_s: float = 0.1):
    """Run the keeper from now: the holder's slice ends ``slice_end_s`` from now, control comes back
    ``return_s`` from now at the latest; ``lender``: the tenant whose turn the holder runs in; ``hold``:
    priority holds, a burst for at most ``hold_max_s``, earning ``hold_rate`` of the time as credit from
    ``hold_credit_s`` (also the most saved up)."""
    now = time.monotonic_ns()
    out = _turns.take_turns(
        gate=policy.gate_address, bell=policy.bell_address, heartbeat=policy.heartbeat_address,
        bell_seen=policy.bell_value() if bell_seen is None else bell_seen, gen=policy.gen, beside=beside,
        holder=holder, slice_start_ns=now, slice_end_ns=now + int(slice_end_s * 1e9),
        return_ns=now + int(return_s * 1e9), base_slice_ns=int(base_slice_s * 1e9), recent_ns=2_000_000,
        drain_timeout_ns=int(drain_timeout_s * 1e9), slice_end_word=policy.slice_end_address,
        grace_ns=int(grace_s * 1e9), shares=[t.share for t in tenants],
        priorities=[t.priority for t in tenants],
        used=used or [0.0] * len(tenants), procs=[p.entry for p in pages], offsets=KEEPER_OFFSETS,
        lender_word=policy.lender_mask_address, lender=lender, lend_end_ns=lend_end_ns,
        hold_word=policy.hold_mask_address if hold else 0, hold_max_ns=int(hold_max_s * 1e9),
        hold_rate=hold_rate, hold_credit_ns=int(hold_credit_s * 1e9),
        hold_credit_cap_ns=int(hold_credit_s * 1e9))
    return Turns(out["reason"], out["holder"], out["gen"], out["slice_start_ns"], out["slice_end_ns"],
                 out["grants"], out["held_ns"], out["drain_timeouts"], out["yields"], out["lender"],
                 out["lend_end_ns"], out["lends"], out["reclaims"], out["holds"], out["hold_ns"],
                 out["hold_credit_ns"])


def busy() -> dict:
    return {"window_open": 1, "last_launch_ns": time.monotonic_ns()}


def test_a_waiting_tenant_gets_the_gpu_when_the_slice_ends(policy, tenants):
    policy.set_gate(0b01)
    pages = [Page(0).set(**busy()), Page(1).set(waiting=1)]
    woken = threading.Event()

    def held_thread():  # a launching thread of b, asleep on the gate as the library's is
        seen = policy.gate
        while not policy.gate & 0b10:
            policy.map.futex_wait(24, seen, 5.0)
            seen = policy.gate
        woken.set()

    t = threading.Thread(target=held_thread)
    t.start()
    reason, holder, gen, start, end, grants, held, *_ = keep(
        policy, tenants, pages, holder=0, slice_end_s=0.005, return_s=0.012, used=[0.7, 0.0])
    t.join(5)
    assert woken.is_set()
    assert holder == 1 and grants[1] >= 1
    assert policy.gate == (gen << 16) | 0b10  # b alone, under a new generation
    assert reason == _turns.RETURN_DEADLINE
    assert held[0] >= 4_000_000  # a held it until its slice's end
    assert end - start == pytest.approx(10_000_000, rel=0.01)  # b's turn: the base slice (the smaller share)


def test_the_holder_goes_on_while_nobody_else_waits(policy, tenants):
    gate = policy.set_gate(0b01)
    pages = [Page(0).set(**busy()), Page(1)]
    called = time.monotonic_ns()
    reason, holder, gen, _, end, grants, held, *_ = keep(policy, tenants, pages, holder=0, slice_end_s=0.002,
                                                     return_s=0.03)
    assert reason == _turns.RETURN_DEADLINE and holder == 0
    assert gen == policy.gen == gate and policy.gate == (gate << 16) | 0b01  # the gate was never written
    assert grants == (1, 0)  # renewed once, until the keeper's deadline rather than slice by slice
    assert end >= called + 30_000_000
    assert sum(held) >= 25_000_000


def test_the_larger_share_gets_the_longer_turn(policy, tenants):
    policy.set_gate(0b10)
    pages = [Page(0).set(waiting=1), Page(1).set(**busy())]
    _, holder, _, start, end, *_ = keep(policy, tenants, pages, holder=1, used=[0.0, 0.3], return_s=0.015)
    assert holder == 0
    assert end - start == pytest.approx(0.01e9 * 0.7 / 0.3, rel=0.01)


def ring_once_the_keeper_sleeps(policy: Policy, seen: int) -> threading.Thread:
    """A tenant's bell, rung once the keeper (this thread) sleeps on it."""
    keeper_tid = threading.get_native_id()

    def ring():
        deadline = time.monotonic() + 5
        while not in_futex_wait(keeper_tid) and time.monotonic() < deadline:
            time.sleep(0.001)
        ctypes.c_uint32.from_address(policy.bell_address).value = seen + 1
        policy.bell.futex_wake(0)

    t = threading.Thread(target=ring)
    t.start()
    return t


def test_a_bell_returns_control_at_once(tmp_path):
    tenants = [TenantPolicy("a", 0.7), TenantPolicy("b", 0.3, priority=1)]
    policy = Policy(str(tmp_path / "ledger-p"), tenants)
    policy.set_gate(0b01)
    pages = [Page(0).set(**busy()), Page(1).set(waiting=1)]  # b may preempt: the controller decides
    seen = policy.bell_value()
    t = ring_once_the_keeper_sleeps(policy, seen)
    t0 = time.monotonic()
    reason, holder, *_ = keep(policy, tenants, pages, holder=0, slice_end_s=10.0, return_s=10.0,
                              bell_seen=seen)
    t.join()
    policy.close()
    assert reason == _turns.RETURN_BELL and holder == 0
    assert time.monotonic() - t0 < 5.0


def test_a_bell_that_changes_nothing_keeps_the_turns_in_c(policy, tenants):
    """A thread that began to wait while a drain closed the gate rings; the busy holder's turn goes on
    without a return to Python."""
    policy.set_gate(0b01)
    pages = [Page(0).set(**busy()), Page(1).set(waiting=1)]
    seen = policy.bell_value()
    t = ring_once_the_keeper_sleeps(policy, seen)
    turns = keep(policy, tenants, pages, holder=0, slice_end_s=10.0, return_s=0.3, bell_seen=seen)
    t.join()
    assert turns.reason == _turns.RETURN_DEADLINE and turns.holder == 0


def test_a_quiet_holder_lends_the_rest_of_its_turn_and_keeps_its_claim(policy, tenants):
    policy.set_gate(0b01)
    quiet = time.monotonic_ns() - 10 * QUIET_NS
    pages = [Page(0).set(last_launch_ns=quiet), Page(1).set(waiting=1)]
    seen = policy.bell_value()
    t = ring_once_the_keeper_sleeps(policy, seen)  # its helper rings: nothing queued, no launch since
    before = time.monotonic_ns()
    turns = keep(policy, tenants, pages, holder=0, slice_end_s=1.0, return_s=0.2, bell_seen=seen)
    t.join()
    assert turns.reason == _turns.RETURN_DEADLINE
    assert (turns.holder, turns.lender, turns.lends, turns.reclaims) == (1, 0, 1, 0)
    assert policy.gate == (turns.gen << 16) | 0b10 and policy.lender_mask == 0b01
    assert turns.end == turns.lend_end  # b runs in the rest of a's turn
    assert before + 0.9e9 < turns.lend_end < before + 1.1e9
    assert turns.grants == (0, 1)


def test_the_lender_takes_its_turn_back_at_its_next_launch(policy, tenants):
    policy.set_gate(0b10)
    policy.set_lender_mask(0b01)
    pages = [Page(0).set(waiting=1), Page(1).set(**busy())]  # a's launching thread is held: it rang
    seen = policy.bell_value()
    t = ring_once_the_keeper_sleeps(policy, seen)
    lend_end = time.monotonic_ns() + 10**9
    turns = keep(policy, tenants, pages, holder=1, slice_end_s=1.0, return_s=0.2, bell_seen=seen, lender=0,
                 lend_end_ns=lend_end)
    t.join()
    assert (turns.holder, turns.lender, turns.reclaims) == (0, -1, 1)
    assert turns.end == lend_end  # the rest of its own turn, not a new one
    assert policy.gate == (turns.gen << 16) | 0b01 and policy.lender_mask == 0
    assert turns.held[1] > 0  # b held the GPU until then: its time, not a's


@pytest.mark.parametrize("used, claims", [([0.1, 0.5], True), ([0.9, 0.05], False)])
def test_an_idle_holder_keeps_its_claim_at_its_turns_end_within_its_share(policy, tenants, used, claims):
    """On the host when its turn ends (a training step's host work), a tenant within its share lends
    the next turn it is due at once; one over its share loses it."""
    policy.set_gate(0b01)
    pages = [Page(0).set(last_launch_ns=time.monotonic_ns() - 10**8), Page(1).set(waiting=1)]
    turns = keep(policy, tenants, pages, holder=0, slice_end_s=0.0, return_s=0.01, used=used)
    assert turns.holder == 1
    if claims:
        assert (turns.lender, turns.lends) == (0, 1) and policy.lender_mask == 0b01
        assert turns.end == turns.lend_end
        assert turns.end - turns.start == pytest.approx(0.01e9 * 0.7 / 0.3, rel=0.01)  # a's turn, lent
    else:
        assert (turns.lender, turns.lends) == (-1, 0) and policy.lender_mask == 0


def test_a_quiet_holder_with_nobody_waiting_hands_back_to_the_controller(policy, tenants):
    policy.set_gate(0b01)
    pages = [Page(0).set(last_launch_ns=time.monotonic_ns() - 10**9), Page(1)]
    reason, holder, *_ = keep(policy, tenants, pages, holder=0, slice_end_s=0.0, return_s=5.0)
    assert reason == _turns.RETURN_IDLE and holder == 0


def test_an_exited_tenant_process_returns_control(policy, tenants):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid no longer exists
    policy.set_gate(0b01)
    pages = [Page(0).set(**busy()), Page(1, pid=gone.pid).set(waiting=1)]
    reason, holder, *_ = keep(policy, tenants, pages, holder=0, slice_end_s=0.0, return_s=5.0)
    assert reason == _turns.RETURN_GONE and holder == 0


def test_tenants_beside_the_holder_keep_their_bit_and_are_never_handed_a_turn(policy, tenants):
    three = [*tenants, TenantPolicy("c", 0.0001, priority=1)]
    p = Policy(policy.prefix + "3", three)
    try:
        p.set_gate(0b101)
        pages = [Page(0).set(**busy()), Page(1).set(waiting=1), Page(2).set(waiting=1)]
        _, holder, gen, *_ = keep(p, three, pages, holder=0, used=[0.7, 0.0, 0.0], beside=0b100)
        assert holder == 1
        assert p.gate == (gen << 16) | 0b110
    finally:
        p.close()


@pytest.mark.parametrize("seed", range(40))
def test_the_next_holder_is_the_one_the_python_scheduler_picks(tmp_path, seed):
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    tenants = [TenantPolicy(f"t{i}", rng.choice([0.1, 0.2, 0.25, 0.4]), rng.choice([0, 0, 1, 2]))
               for i in range(n)]
    # the keeper adds the holder's microseconds in this call to its use before it picks: no exact ties
    used = [rng.uniform(0.01, 1.0) for _ in range(n)]
    holder = rng.randrange(n)
    holder_wants = rng.random() < 0.5
    waiting = {s for s in range(n) if s != holder and rng.random() < 0.7} or {(holder + 1) % n}
    scheduler = SliceScheduler(tenants)
    scheduler.used = list(used)
    expected = scheduler.pick(waiting | ({holder} if holder_wants else set()), 0.0)
    # an idle holder within its share keeps its claim: the pick is lent its turn
    lends = not holder_wants and scheduler.keeps_claim(holder, waiting, 0.0)
    p = Policy(str(tmp_path / "ledger"), tenants)
    try:
        p.set_gate(1 << holder)
        pages = [Page(s).set(waiting=int(s in waiting), **(busy() if s == holder and holder_wants else {}))
                 for s in range(n)]
        turns = keep(p, tenants, pages, holder=holder, used=used, base_slice_s=1.0, return_s=0.005)
        assert turns.holder == expected
        assert turns.lender == (holder if lends else -1)
        # and the turn is as long as the Python scheduler makes it: the claimant's when lent
        wanting = waiting | ({holder} if holder_wants else set())
        owner = holder if lends else expected
        quantum_ns = scheduler.quantum(owner, wanting, 1.0) * 1e9
        assert turns.end - turns.start == pytest.approx(quantum_ns, rel=1e-3)
    finally:
        p.close()


def test_a_draining_hand_over_waits_for_the_old_holders_work_before_the_next_holder_starts(policy, tenants):
    policy.set_gate(0b01)
    a, b = Page(0).set(**busy()), Page(1).set(waiting=1)
    seen_gates = []

    def helper_of_a():  # posts "drained" a little after the gate closes to it, as the library's helper
        deadline = time.monotonic() + 5
        while policy.gate & 0b01 and time.monotonic() < deadline:
            time.sleep(0.001)
        seen_gates.append(policy.gate)
        time.sleep(0.02)  # its queued work finishing
        seen_gates.append(policy.gate)
        ctypes.c_uint32.from_address(ctypes.addressof(a.buf) + DRAINED).value = policy.gate >> 16
        libc_wake(ctypes.addressof(a.buf) + DRAINED)  # the keeper sleeps on that word

    t = threading.Thread(target=helper_of_a)
    t.start()
    _, holder, gen, _, _, _, held, timeouts, *_ = keep(policy, tenants, [a, b], holder=0, slice_end_s=0.0,
                                                   return_s=0.2, used=[0.7, 0.0], drain_timeout_s=2.0)
    t.join()
    assert holder == 1 and timeouts == 0
    # while a drained, nobody but the tenants beside (none) could launch; then b alone
    assert seen_gates[0] & 0xFFFF == 0 and seen_gates[1] & 0xFFFF == 0
    assert policy.gate == (gen << 16) | 0b10
    assert held[0] >= 15_000_000  # the drain is the old holder's time


def test_a_drain_that_never_comes_times_out_and_is_counted_and_the_heartbeat_goes_on(policy, tenants):
    policy.set_gate(0b01)
    pages = [Page(0).set(**busy()), Page(1).set(waiting=1)]
    t0 = time.monotonic_ns()
    turns = keep(policy, tenants, pages, holder=0, slice_end_s=0.0, return_s=0.2, used=[0.7, 0.0],
                 drain_timeout_s=0.3)
    assert turns.holder == 1 and turns.timeouts == 1
    # tenants fail open when the heartbeat is 2 s old: a long drain must not look like a dead controller
    assert policy.map.u64(P_HEARTBEAT) >= t0 + 250_000_000


def test_a_holder_that_yields_at_its_slice_end_is_handed_on_without_the_keepers_drain(policy, tenants):
    policy.set_gate(0b01)
    a, b = Page(0).set(**busy()), Page(1).set(waiting=1)
    gates = []

    def helper_of_a():  # what the library does: stop at the published end, drain, post, ring
        deadline = time.monotonic() + 5
        while not policy.slice_end_ns and time.monotonic() < deadline:
            time.sleep(0.0005)
        end = policy.slice_end_ns
        while time.monotonic_ns() < end:
            time.sleep(0.0005)
        gate = policy.gate
        gates.append(gate)
        ctypes.c_uint32.from_address(ctypes.addressof(a.buf) + DRAINED).value = gate >> 16
        bell = ctypes.c_uint32.from_address(policy.bell_address)
        bell.value += 1
        policy.bell.futex_wake(0)

    t = threading.Thread(target=helper_of_a)
    t.start()
    turns = keep(policy, tenants, [a, b], holder=0, slice_end_s=0.01, return_s=0.2, used=[0.7, 0.0],
                 drain_timeout_s=2.0, grace_s=1.0)
    t.join()
    assert turns.holder == 1 and turns.yields == 1 and turns.timeouts == 0
    assert gates[0] & 0xFFFF == 0b01  # a still held the gate when it yielded: the keeper never closed it
    assert policy.slice_end_ns == 0  # cleared once the Python loop has control again


def test_a_holder_that_does_not_yield_is_drained_once_the_grace_has_passed(policy, tenants):
    policy.set_gate(0b01)
    pages = [Page(0).set(**busy()), Page(1).set(waiting=1)]
    t0 = time.monotonic()
    turns = keep(policy, tenants, pages, holder=0, slice_end_s=0.0, return_s=0.5, used=[0.7, 0.0],
                 drain_timeout_s=0.01, grace_s=0.03)
    # nobody posted: drained by the keeper, timed out
    assert turns.holder == 1 and turns.yields == 0 and turns.timeouts == 1
    assert time.monotonic() - t0 >= 0.03


def libc_wake(address: int) -> None:
    from gpuscope.share.ledger import _words

    _words.futex_wake(address)


def test_bad_arguments_raise_instead_of_crashing(policy, tenants):
    with pytest.raises(TypeError):
        _turns.take_turns(1, 2, 3)  # keywords only
    with pytest.raises(TypeError, match="take_turns"):
        _turns.take_turns(gate=1)  # every one of them
    with pytest.raises(ValueError, match="pid"):
        _turns.helper_wake_bit(-1)
    with pytest.raises(ValueError, match="holder"):
        keep(policy, tenants, [], holder=5)
    with pytest.raises(ValueError, match="used"):
        keep(policy, tenants, [], used=[0.0])
    assert policy.gate & 0xFFFF == OPEN_MASK  # nothing was written


FUTEX_WAIT_BITSET = 9


def sleep_on_gate(policy: Policy, bitset: int, timeout_s: float) -> bool:
    """Sleep on the gate word with ``bitset``, as a helper thread of the library does; True if a wake
    with that bit ended the sleep, False if it timed out (a change of the word alone wakes no one)."""
    deadline = time.monotonic() + timeout_s  # FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC time
    ts = _Timespec(int(deadline), int(deadline % 1 * 1e9))
    while True:
        rc = _libc.syscall(SYS_FUTEX, ctypes.c_void_p(policy.gate_address), FUTEX_WAIT_BITSET,
                           ctypes.c_uint32(policy.gate), ctypes.byref(ts), None, ctypes.c_uint32(bitset))
        if rc == 0:
            return True
        if ctypes.get_errno() == errno.ETIMEDOUT:
            return False
        # EAGAIN: the word changed before this thread slept; sleep on its new value


def in_futex_wait(tid: int) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            return f.read().split()[0] == str(SYS_FUTEX)
    except (OSError, IndexError):
        return False


def test_a_drain_wakes_the_old_holders_helper_and_no_other_tenants(policy, tenants):
    """Each helper sleeps with a bit of its own (its pid's); the keeper's drain wakes only the bits of
    the old holder's processes, so the other tenants' helpers sleep on."""
    others = []
    try:
        while True:  # a live process whose helper bit differs from this one's
            others.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            if _turns.helper_wake_bit(others[-1].pid) != _turns.helper_wake_bit(os.getpid()):
                break
        a, b = Page(0).set(**busy()), Page(1, pid=others[-1].pid).set(waiting=1)
        policy.set_gate(0b01)
        woken, tids = {}, {}

        def helper(name: str, page: Page, posts: bool) -> None:
            tids[name] = threading.get_native_id()
            woken[name] = sleep_on_gate(policy, _turns.helper_wake_bit(page.pid), 1.5 if not posts else 5.0)
            if posts:  # the old holder's helper: its queued work is done
                ctypes.c_uint32.from_address(ctypes.addressof(page.buf) + DRAINED).value = policy.gate >> 16
                libc_wake(ctypes.addressof(page.buf) + DRAINED)

        threads = [threading.Thread(target=helper, args=("a", a, True)),
                   threading.Thread(target=helper, args=("b", b, False))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while not (len(tids) == 2 and all(in_futex_wait(tid) for tid in tids.values())):
            assert time.monotonic() < deadline, "the helper threads never went to sleep"
            time.sleep(0.001)
        turns = keep(policy, tenants, [a, b], holder=0, slice_end_s=0.0, return_s=0.2, used=[0.7, 0.0],
                     drain_timeout_s=2.0)
        holder, timeouts = turns.holder, turns.timeouts
        for t in threads:
            t.join(10)
        assert holder == 1 and timeouts == 0
        assert woken == {"a": True, "b": False}  # b's helper slept through the drain and the grant
    finally:
        for p in others:
            p.kill()
            p.wait()


def test_the_quiet_threshold_is_one_figure_for_c_and_python():
    assert _turns.QUIET_NS == QUIET_NS


def poll(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def ring(policy: Policy) -> None:
    bell = ctypes.c_uint32.from_address(policy.bell_address)
    bell.value += 1
    policy.bell.futex_wake(0)


@pytest.fixture
def latency_pair():
    """A GPU-bound tenant of priority 0 and a latency tenant of priority 1 beside it."""
    return [TenantPolicy("hog", 0.7), TenantPolicy("online", 0.3, priority=1)]


def burst_in_thread(policy: Policy, page: Page, seen: int, *, end: bool = True):
    """The latency tenant's library: once the keeper sleeps, a burst begins (posted, rung); once the
    holder's bit is clear it ends (cleared, rung), or with ``end`` False never does. What the gate and
    the hold mask read at each step, and how long the holder's bit stayed clear, come back in a dict."""
    keeper_tid = threading.get_native_id()
    seen_states: dict = {}

    def run():
        poll(lambda: in_futex_wait(keeper_tid))
        page.set(burst_ns=time.monotonic_ns())
        ring(policy)
        held = poll(lambda: policy.gate & 0b01 == 0, 2.0)
        t0 = time.monotonic()
        seen_states.update(held=held, gate_held=policy.gate & 0xFFFF, hold_mask=policy.hold_mask)
        if end:
            page.set()
            ring(policy)
        seen_states["released"] = poll(lambda: policy.gate & 0b01 != 0, 2.0)
        seen_states.update(held_s=time.monotonic() - t0, hold_mask_after=policy.hold_mask)

    t = threading.Thread(target=run)
    t.start()
    return t, seen_states


def keep_through_a_burst(tmp_path, tenants, *, end: bool = True, **hold):
    """The hog (slot 0, busy) holds the GPU and the latency tenant (slot 1) runs beside it; the keeper
    runs for a second with priority holds on (``hold``: keep()'s hold arguments) while a burst of the
    latency tenant begins, and ends unless ``end`` is False. Returns what keep() returned, what the
    burst's thread saw (burst_in_thread) and the gate and hold mask after."""
    policy = Policy(str(tmp_path / "ledger-h"), tenants)
    try:
        policy.set_gate(0b11)
        hog, online = Page(0).set(**busy()), Page(1)
        seen = policy.bell_value()
        t, states = burst_in_thread(policy, online, seen, end=end)
        turns = keep(policy, tenants, [hog, online], holder=0, slice_end_s=10.0, return_s=1.0, beside=0b10,
                     bell_seen=seen, hold=True, **hold)
        t.join()
        return turns, states, policy.gate & 0xFFFF, policy.hold_mask
    finally:
        policy.close()


def test_a_burst_of_a_tenant_of_higher_priority_holds_the_holder_until_it_ends(tmp_path, latency_pair):
    turns, states, gate, hold_mask = keep_through_a_burst(tmp_path, latency_pair)
    assert states["held"] and states["gate_held"] == 0b10 and states["hold_mask"] == 0b01
    assert states["released"] and states["hold_mask_after"] == 0
    assert turns.reason == _turns.RETURN_DEADLINE  # both bells were the burst's: no return to Python
    assert turns.holds == 1 and 0 < turns.hold_ns < 1e9
    assert gate == 0b11 and hold_mask == 0


def test_a_burst_that_never_ends_holds_the_holder_no_longer_than_its_limit(tmp_path, latency_pair):
    turns, states, *_ = keep_through_a_burst(tmp_path, latency_pair, end=False, hold_max_s=0.05)
    assert states["held"] and states["released"]  # while its burst_ns still says it runs
    assert turns.holds == 1 and 0.04e9 <= turns.hold_ns < 0.9e9


def test_bursts_hold_the_holder_for_no_more_than_the_credit_their_share_earns(tmp_path, latency_pair):
    # 20 ms saved up and none earned: the hold ends when they are spent, long before its 1 s limit
    turns, states, *_ = keep_through_a_burst(tmp_path, latency_pair, end=False, hold_max_s=1.0, hold_rate=0.0,
                                             hold_credit_s=0.02)
    assert states["held"] and states["released"]
    assert turns.holds == 1 and 0.015e9 <= turns.hold_ns < 0.5e9
    assert turns.hold_credit_ns <= 0


@pytest.mark.parametrize("online_priority, hold, ahead_s", [(0, True, 0.0), (1, False, 0.0), (1, True, 10.0)],
                         ids=["equal-priority", "holds-off", "burst-in-the-future"])
def test_no_hold_for_a_tenant_of_equal_priority_or_with_holds_off(tmp_path, online_priority, hold, ahead_s):
    """Nor for a burst whose word says it begins in the future: the word is the tenant's own, and one
    written ahead would otherwise pass the 20 ms limit of a burst for as long as it stays ahead."""
    tenants = [TenantPolicy("hog", 0.7), TenantPolicy("online", 0.3, priority=online_priority)]
    policy = Policy(str(tmp_path / "ledger-h"), tenants)
    try:
        policy.set_gate(0b11)
        hog, online = Page(0).set(**busy()), Page(1)
        seen = policy.bell_value()
        keeper_tid = threading.get_native_id()

        def burst():
            poll(lambda: in_futex_wait(keeper_tid))
            online.set(burst_ns=time.monotonic_ns() + int(ahead_s * 1e9))
            ring(policy)

        t = threading.Thread(target=burst)
        t.start()
        turns = keep(policy, tenants, [hog, online], holder=0, slice_end_s=10.0, return_s=0.3, beside=0b10,
                     bell_seen=seen, hold=hold)
        t.join()
        assert turns.holds == 0 and turns.hold_ns == 0
        assert policy.gate & 0xFFFF == 0b11 and policy.hold_mask == 0
    finally:
        policy.close()


def test_bursts_one_after_another_are_cut_at_the_limit_and_the_keeper_sleeps_between(tmp_path, latency_pair):
    """A tenant's processes may keep a burst going one after another (or a process rewrite its word):
    each hold is still cut hold_max after it began, by the keeper's clock, and a new one starts only
    for a burst that began after that. Timing the cut wakes the keeper once, not a spin: with the burst
    restarted every 5 ms the hold used to end past its limit and the keeper woke every microsecond."""
    policy = Policy(str(tmp_path / "ledger-h"), latency_pair)
    try:
        policy.set_gate(0b11)
        hog, online = Page(0).set(**busy()), Page(1)
        done = threading.Event()

        def bursts():  # a new burst every 5 ms, rung only the first time
            online.set(burst_ns=time.monotonic_ns())
            ring(policy)
            while not done.wait(0.005):
                online.set(burst_ns=time.monotonic_ns())

        t = threading.Thread(target=bursts)
        cpu0, wall0 = time.thread_time(), time.monotonic()
        t.start()
        try:
            turns = keep(policy, latency_pair, [hog, online], holder=0, slice_end_s=10.0, return_s=0.5,
                         beside=0b10, hold=True, hold_max_s=0.05, hold_rate=1.0, hold_credit_s=1.0)
        finally:
            done.set()
            t.join()
        cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
        assert turns.holds >= 2  # cut, then held again for a later burst
        assert turns.hold_ns <= turns.holds * 0.06e9, turns  # each at most its 50 ms, and a wake-up
        assert cpu < 0.5 * wall, (cpu, wall)  # asleep between its looks
    finally:
        policy.close()
