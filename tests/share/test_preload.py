"""The preload library against a fake driver: interception on every path, pass-through, fail-open,
nothing lost or reordered, and the accounting windows' GPU time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from gpuscope.share.ledger import Policy, TenantPolicy
from tests.conftest import wait_for
from tests.share.fakecuda import Joined, child_env, finish, launch, read_log


def test_every_path_is_intercepted_and_nothing_is_lost_or_reordered(fake_cuda, tmp_path):
    log = tmp_path / "log"
    result, err = finish(launch(child_env(fake_cuda, log), 4))
    hooks = result["hooks"]
    assert hooks is not None, "the library's exports were not found in the process"
    paths = result["paths"]
    # dlsym on the dlopen handle, cuGetProcAddress v1 and v2: all hand out the library's hooks,
    # and the per-thread flag hands out the _ptsz hook
    assert paths["dlsym"] == paths["gpa_v1"] == paths["gpa_v2"] == hooks["cuLaunchKernel"]
    assert paths["dlsym_ptsz"] == paths["gpa_v2_ptsz"] == hooks["cuLaunchKernel_ptsz"]
    assert result["stats"]["launches"] == len(result["launched"]) == 4 * 7
    assert result["stats"]["graph_launches"] == 4
    rows = read_log(log)
    # every launch reached the driver once, in call order (so in order on each stream), through the
    # variant it was asked for
    assert [[s, q] for _, s, q in rows] == result["launched"]
    assert [name for name, _, q in rows[:7]] == [
        "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernel", "cuLaunchKernel", "cuLaunchKernel_ptsz",
        "cuLaunchKernelEx", "cuGraphLaunch"]
    assert err == ""  # not a tenant: silent


def test_without_the_library_the_same_calls_reach_the_driver(fake_cuda, tmp_path):
    with_lib, without = tmp_path / "with", tmp_path / "without"
    finish(launch(child_env(fake_cuda, with_lib), 3))
    result, _ = finish(launch(child_env(fake_cuda, without, preload=False), 3))
    assert result["hooks"] is None
    assert read_log(with_lib) == read_log(without)


def test_symbol_interposition_for_a_program_linked_against_libcuda(fake_cuda, tmp_path):
    log = tmp_path / "log"
    run = subprocess.run([str(fake_cuda / "linked")], env=child_env(fake_cuda, log), capture_output=True,
                         text=True, check=True)
    assert run.stdout.strip() == "10"
    assert [q for _, _, q in read_log(log)] == list(range(1000, 1010))
    env = child_env(fake_cuda, tmp_path / "l2", preload=False)
    plain = subprocess.run([str(fake_cuda / "linked")], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "-1"


def test_a_tenant_without_a_controller_passes_through_and_says_so_once(fake_cuda, tmp_path):
    log = tmp_path / "log"
    env = child_env(fake_cuda, log, tenant="batch", ledger=str(tmp_path / "no-ledger"))
    result, err = finish(launch(env, 5))
    assert err.count("gpuscope-share:") == 1
    assert "no controller at" in err and "batch runs unthrottled until a controller starts" in err
    assert result["stats"]["launches"] == 35 and result["stats"]["joined"] == 0
    assert len(read_log(log)) == 35


def test_an_unknown_tenant_runs_unthrottled(fake_cuda, tmp_path):
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5)])
    try:
        policy.set_gate(0)  # nobody may launch: an unknown tenant must not be held
        env = child_env(fake_cuda, tmp_path / "log", tenant="stranger", ledger=policy.prefix)
        result, err = finish(launch(env, 2))
        assert "no share named stranger" in err
        assert result["stats"]["launches"] == 14
    finally:
        policy.close()


def test_a_joined_tenant_accounts_gpu_time_in_windows(fake_cuda, tmp_path):
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    try:
        env = child_env(fake_cuda, tmp_path / "log", tenant="b", ledger=policy.prefix)
        result, err = finish(launch(env, 20, "wait-gpu-ns"))
        stats = result["stats"]
        assert stats["joined"] == 1 and stats["failed_open"] == 0 and stats["hook_errors"] == 0
        # the fake GPU clock: 6 launches of 5 µs and one graph of 100 µs per round
        assert stats["gpu_ns"] == pytest.approx(20 * 130_000, rel=0.01)
        assert 0 < stats["windows"] <= stats["launches"]
        assert err == ""
        joined = Joined(policy)
        wait_for(lambda: joined.poll() is not None and ("leave", joined.events[0][1]) in joined.events,
                 what="its exit to end its connection")
        assert [kind for kind, _ in joined.events] == ["join", "leave"]
    finally:
        policy.close()


ONE_STREAM = """
import ctypes, json, sys, time
cuda = ctypes.CDLL('libcuda.so.1'); own = ctypes.CDLL(None); U = ctypes.c_uint
for n in range(40):  # 50 µs of fake GPU time each, all on stream 1
    cuda.cuLaunchKernel(None, U(n), U(1), U(1), U(50), U(1), U(1), U(0), ctypes.c_void_p(1), None, None)
out = (ctypes.c_uint64 * 8)()
deadline = time.monotonic() + (10 if sys.argv[1] == "timed" else 0.3)
while True:  # until the helper posted the last window (untimed: a moment to show nothing is posted)
    own.gpuscope_share_stats(out)
    if out[4] >= 40 * 50_000 or out[5] >= 40 or time.monotonic() > deadline:
        break
    time.sleep(0.01)
print(json.dumps({"launches": out[0], "windows": out[5], "gpu_ns": out[4], "hook_errors": out[2]}))
"""


@pytest.mark.parametrize("role", ["holder", "beside", "probe"])
def test_how_a_tenant_times_its_launches_in_each_role(fake_cuda, tmp_path, role):
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5, 1)])
    try:
        policy.set_gate(0b11)  # shares bind; both may launch
        policy.set_beside_mask(0 if role == "holder" else 0b10)
        policy.set_busy_mask(0b10 if role == "probe" else 0)
        env = child_env(fake_cuda, tmp_path / "log", tenant="b", ledger=policy.prefix)
        proc = subprocess.run([sys.executable, "-c", ONE_STREAM, "untimed" if role == "beside" else "timed"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        assert stats["launches"] == 40 and stats["hook_errors"] == 0
        if role == "beside":  # beside the holder: no events at all (each would cost a context switch)
            assert stats["windows"] == 0 and stats["gpu_ns"] == 0
        elif role == "holder":  # windows span launches
            assert stats["gpu_ns"] == 40 * 50_000 and stats["windows"] < 40
        else:
            # each kernel a window of its own; this fake GPU's clock stands still between launches,
            # so a probe takes off up to the launch calls' few microseconds (busy_window_ms)
            assert stats["windows"] == 40 and 0.9 * 40 * 50_000 <= stats["gpu_ns"] <= 40 * 50_000
    finally:
        policy.close()


PROBED = """
import ctypes, json, sys, time
cuda = ctypes.CDLL('libcuda.so.1'); own = ctypes.CDLL(None); U = ctypes.c_uint
kernel_us, n = int(sys.argv[1]), 40
for i in range(n):  # all on stream 1
    cuda.cuLaunchKernel(None, U(i), U(1), U(1), U(kernel_us), U(1), U(1), U(0), ctypes.c_void_p(1),
                        None, None)
out = (ctypes.c_uint64 * 8)()
deadline = time.monotonic() + 20
while True:  # until the last window is posted
    own.gpuscope_share_stats(out)
    if out[5] >= n or time.monotonic() > deadline:
        break
    time.sleep(0.01)
print(json.dumps({"windows": out[5], "gpu_ns": out[4], "hook_errors": out[2]}))
"""


@pytest.mark.parametrize(("kernel_us", "launch_us"), [(50, 300), (2000, 0)])
def test_a_probe_charges_kernels_not_the_launch_calls_between_them(fake_cuda, tmp_path, kernel_us, launch_us):
    """Launch-bound (each launch call takes 300 µs of CPU, each kernel 50 µs on a GPU that runs in
    real time): a probe's start event runs at once on the idle stream, the kernel only when the launch
    call is through, so each window spans the call too; what is charged is the kernel. GPU-bound
    (queued kernels of 2 ms): nothing comes off."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5, 1)])
    try:
        policy.set_gate(0b11)
        policy.set_beside_mask(0b10)
        policy.set_busy_mask(0b10)
        env = child_env(fake_cuda, tmp_path / "log", tenant="b", ledger=policy.prefix)
        env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_LAUNCH_US=str(launch_us))
        proc = subprocess.run([sys.executable, "-c", PROBED, str(kernel_us)], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        assert stats["windows"] == 40 and stats["hook_errors"] == 0
        kernels_ns = 40 * kernel_us * 1000
        if launch_us:
            # each window spans its launch call too: 7x the kernels' time if nothing came off (a
            # launch call preempted after its kernel went out may lose that window's kernel)
            assert 0.6 * kernels_ns <= stats["gpu_ns"] < 1.5 * kernels_ns
        else:
            assert 0.95 * kernels_ns <= stats["gpu_ns"] <= 1.1 * kernels_ns
    finally:
        policy.close()


SYNCED_STEPS = """
import ctypes, json
cuda = ctypes.CDLL('libcuda.so.1'); own = ctypes.CDLL(None); U = ctypes.c_uint
out = (ctypes.c_uint64 * 8)()
posted = []
for step in range(30):  # three kernels of 50 µs of fake GPU time, then a wait for the GPU
    for _ in range(3):
        cuda.cuLaunchKernel(None, U(1), U(1), U(1), U(50), U(1), U(1), U(0), ctypes.c_void_p(1), None, None)
    cuda.cuCtxSynchronize()
    own.gpuscope_share_stats(out)  # at once: no time for the helper thread to post anything
    posted.append(out[4])
print(json.dumps({"posted_gpu_ns": posted, "hook_errors": out[2]}))
"""


def test_a_slice_holder_posts_its_windows_when_its_wait_for_the_gpu_returns(fake_cuda, tmp_path):
    """A holder that syncs every step posts its finished windows itself as each wait returns, so its
    helper thread need not wake for each window."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    try:
        policy.set_gate(0b10)  # shares bind and b holds the slice
        env = child_env(fake_cuda, tmp_path / "log", tenant="b", ledger=policy.prefix)
        proc = subprocess.run([sys.executable, "-c", SYNCED_STEPS], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        assert stats["hook_errors"] == 0
        assert stats["posted_gpu_ns"] == [150_000 * (step + 1) for step in range(30)]
    finally:
        policy.close()


QUEUED_BESIDE = """
import ctypes, sys, time
cuda = ctypes.CDLL('libcuda.so.1'); U = ctypes.c_uint
stream, kernel_us = int(sys.argv[1]), int(sys.argv[2])
started = time.monotonic()
for i in range(40):  # on a GPU that runs in real time, nothing waited for
    cuda.cuLaunchKernel(None, U(i), U(1), U(1), U(kernel_us), U(1), U(1), U(0), ctypes.c_void_p(stream),
                        None, None)
print(started, flush=True)
sys.stdin.read()  # until the test is done with it
"""


@pytest.mark.parametrize("captured", [False, True])
def test_a_tenant_beside_the_holder_drains_its_queued_kernels_when_its_gate_closes(fake_cuda, tmp_path,
                                                                                  captured):
    """Launching untimed beside the holder, a tenant has no windows to wait on: when its gate closes
    (another tenant's probe starts), its process says it has drained only once the kernels it queued
    have run, which a probe of another tenant would otherwise time as that tenant's. Not on a stream
    being captured into a graph (the fake's stream 99): waiting there would break the capture."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    try:
        policy.set_gate(0b11)
        policy.set_beside_mask(0b10)
        env = child_env(fake_cuda, tmp_path / "log", tenant="b", ledger=policy.prefix)
        env.update(FAKE_CUDA_REALTIME="1")
        # 40 kernels of 2 ms (80 ms queued), or of 100 ms on the captured stream (4 s)
        argv = ["99", "100000"] if captured else ["1", "2000"]
        child = subprocess.Popen([sys.executable, "-c", QUEUED_BESIDE, *argv], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        joined = Joined(policy)
        try:
            started = float(child.stdout.readline())
            view = joined.one()
            closed = time.monotonic()
            gen = policy.set_gate(0b01)  # a probe of a: b paused
            assert view.wait_drained(gen, 10.0)
            drained = time.monotonic()
            if captured:
                assert drained - closed < 2.0  # not the 4 s of captured work
            else:
                assert drained >= started + 0.075  # its 80 ms of kernels ran first (less the clock's slack)
            assert view.counter("hook_errors") == 0
        finally:
            joined.close()
            child.communicate("", timeout=30)
        assert child.returncode == 0
    finally:
        policy.close()


DUTY_LOOP = """
import ctypes, json, time
cuda = ctypes.CDLL('libcuda.so.1'); own = ctypes.CDLL(None); U = ctypes.c_uint
t0 = time.monotonic()
n = 0
while time.monotonic() - t0 < 0.5:  # launch all the time, 5 µs kernels
    cuda.cuLaunchKernel(None, U(n), U(1), U(1), U(5), U(1), U(1), U(0), ctypes.c_void_p(1), None, None)
    n += 1
out = (ctypes.c_uint64 * 8)()
own.gpuscope_share_stats(out)
print(json.dumps({"launches": out[0], "throttled_ns": out[3], "gpu_ns": out[4],
                  "elapsed_ns": (time.monotonic() - t0) * 1e9}))
"""


@pytest.mark.parametrize("role", ["beside", "probe", "holder"])
def test_a_tenant_beside_the_holder_launches_only_in_its_duty(fake_cuda, tmp_path, role):
    """Duty 0.4: beside the holder the tenant's launching thread sleeps through the last 60% of every
    10 ms, and so does the holder's (the controller gives a holder a duty only where it is the lone
    one, --share.lone-holder duty), whose window then ends before it sleeps: the sleep is not charged
    as its GPU time. In a probe (measuring its busy time) the duty does not apply."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5, 1)])
    try:
        policy.set_gate(0b11)
        policy.set_beside_mask(0 if role == "holder" else 0b10)
        policy.set_busy_mask(0b10 if role == "probe" else 0)
        policy.set_duty(1, 0.4)
        assert policy.duty(1) == pytest.approx(0.4)
        env = child_env(fake_cuda, os.devnull, tenant="b", ledger=policy.prefix)
        env["FAKE_CUDA_REALTIME"] = "1"  # kernels take their time on the wall clock: the GPU idles in a sleep
        proc = subprocess.run([sys.executable, "-c", DUTY_LOOP], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        held = stats["throttled_ns"] / stats["elapsed_ns"]
        if role == "probe":
            assert held == 0
        else:
            # 0.6 of the time, less what a busy machine's scheduling adds to the launching part
            assert 0.35 < held < 0.65
        if role == "holder":
            # its windows, posted, hold its kernels and the short queue it keeps under a duty, not the
            # 60% it slept (a window spanning each sleep would charge about all the time)
            assert 0 < stats["gpu_ns"] < 0.75 * stats["elapsed_ns"]
    finally:
        policy.close()


def test_a_closed_gate_holds_launches_until_it_opens(fake_cuda, tmp_path):
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    try:
        policy.set_gate(0b01)  # only a may launch
        log = tmp_path / "log"
        child = launch(child_env(fake_cuda, log, tenant="b", ledger=policy.prefix), 3)
        joined = Joined(policy)
        view = joined.one()
        try:
            wait_for(lambda: view.waiting == 1, what="a thread held at the gate")
            assert view.tenant == "b" and view.slot == 1 and view.pid == child.pid
            assert not log.exists() or read_log(log) == []  # nothing launched while held
            policy.heartbeat()
            policy.set_gate(0b11)
        finally:
            joined.close()
        result, err = finish(child)
        assert result["stats"]["launches"] == 21 and result["stats"]["throttled_ns"] > 0
        assert len(read_log(log)) == 21 and err == ""
    finally:
        policy.close()


LATE_NOW_AND_THEN = """
import ctypes, glob, json, os, time
cuda = ctypes.CDLL('libcuda.so.1'); U = ctypes.c_uint
gaps = [int(us) * 1e-6 for us in os.environ['GAPS_US'].split(',')]
steps, t0 = 0, time.monotonic()
while time.monotonic() - t0 < 1.0:  # three 300 us kernels, a sync, then the Python before the next
    for i in range(3):
        cuda.cuLaunchKernel(None, U(i), U(1), U(1), U(300), U(1), U(1), U(0), ctypes.c_void_p(1), None, None)
    cuda.cuStreamSynchronize(ctypes.c_void_p(1))
    spin = time.perf_counter() + gaps[steps % len(gaps)]
    while time.perf_counter() < spin:
        pass
    steps += 1
helper = next(t for t in glob.glob('/proc/self/task/*')
              if open(t + '/comm').read().strip() == 'gpuscope-share')
status = open(helper + '/status').read().split('\\n')
wakes = next(int(ln.split()[1]) for ln in status if ln.startswith('voluntary_ctxt_switches'))
print(json.dumps({"steps": steps, "helper_wakes": wakes}))
"""


@pytest.mark.parametrize("gaps_us", ["100,100,100,100,100,100,500", "100,200,300,400,500"],
                         ids=["late-one-in-seven", "spread"])
def test_a_holder_that_relaunches_late_now_and_then_does_not_wake_its_helper_at_each_sync(fake_cuda,
                                                                                         tmp_path, gaps_us):
    """A slice holder whose next launch comes 0.1 ms after each sync, and 0.5 ms (past QUIET_NS) after
    one in seven, or 0.1 to 0.5 ms after its syncs in turn, is a program that relaunches at once: its
    syncs do not wake its helper to watch for quiet. Before, one late relaunch started the count of
    quick ones again, and the helper woke about twice a step (on an H100 an encoder's helper woke 306
    times a second); and a relaunch counted as quick only within QUIET_NS, so the spread gaps never
    made the program tight (its helper woke about 2.5 times a step)."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    try:
        policy.set_gate(0b10)  # b holds the GPU
        policy.set_turns_mask(0b11)  # and a takes turns too: b is not alone, its quiet would be lent
        env = child_env(fake_cuda, os.devnull, tenant="b", ledger=policy.prefix)
        env.update(FAKE_CUDA_REALTIME="1", GAPS_US=gaps_us)
        proc = subprocess.run([sys.executable, "-c", LATE_NOW_AND_THEN], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["steps"] > 200, result
        # its 10 ms naps, its windows and a start: 0.18 a step on a quiet machine (2.2 before)
        assert result["helper_wakes"] < 0.5 * result["steps"], result
    finally:
        policy.close()


def test_a_process_held_from_its_first_launch_answers_drains_at_once(fake_cuda, tmp_path):
    """Its helper starts at its first launch let through, so a process held since it joined has none;
    nothing of it is queued, and its waiting thread says so: a drain (a hand-over, another tenant's
    probe) does not wait out the drain timeout for it."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    try:
        policy.set_gate(0b01)  # only a may launch
        child = launch(child_env(fake_cuda, tmp_path / "log", tenant="b", ledger=policy.prefix), 3)
        joined = Joined(policy)
        view = joined.one()
        try:
            wait_for(lambda: view.waiting == 1, what="a thread held at the gate")
            for _ in range(3):  # hand-overs between others, each a closed gate for b
                policy.heartbeat()
                gen = policy.set_gate(0b01)
                started = time.monotonic()
                assert view.wait_drained(gen, 5.0), "no answer to the drain"
                assert time.monotonic() - started < 2.0
            policy.set_gate(0b11)
        finally:
            joined.close()
        result, err = finish(child)
        assert result["stats"]["launches"] == 21 and err == ""
    finally:
        policy.close()


@pytest.mark.parametrize(("gate", "priority", "rings"), [
    (0b01, 0, False),  # a holds, b is no higher: the controller looks at the slice's end anyway
    (0b01, 1, True),  # b may preempt the holder
    (0b00, 0, True),  # nobody holds: the controller must be told
])
def test_a_held_thread_wakes_the_controller_only_when_it_must(fake_cuda, tmp_path, gate, priority, rings):
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5, priority)])
    try:
        policy.set_gate(gate)
        child = launch(child_env(fake_cuda, tmp_path / "log", tenant="b", ledger=policy.prefix), 3)
        joined = Joined(policy)
        view = joined.one()
        try:
            wait_for(lambda: view.waiting == 1, what="a thread held at the gate")
            # the join rang once (the controller adopts the process); a waiter that must rings again
            if rings:
                wait_for(lambda: policy.bell_value() == 2, what="the waiter's ring")
            else:  # it decided in the same instant it started waiting
                assert policy.bell_value() == 1
            policy.heartbeat()
            policy.set_gate(0b11)
        finally:
            joined.close()
        finish(child)
    finally:
        policy.close()


def test_controller_loss_fails_open_once(fake_cuda, tmp_path):
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 1.0)], stale_ms=300)
    beating = threading.Event()
    beating.set()

    def heartbeat() -> None:  # alive until the tenant is held, then gone
        while beating.is_set():
            policy.heartbeat()
            time.sleep(0.02)

    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        policy.set_gate(0)
        log = tmp_path / "log"
        child = launch(child_env(fake_cuda, log, tenant="a", ledger=policy.prefix), 3)
        joined = Joined(policy)
        try:
            view = joined.one()
            wait_for(lambda: view.waiting == 1, what="a thread held at the gate")
        finally:
            joined.close()
        beating.clear()
        beat.join()
        result, err = finish(child)
        assert err.count("gpuscope-share:") == 1 and "controller is gone" in err
        assert result["stats"]["failed_open"] == 1
        assert len(read_log(log)) == 21
    finally:
        beating.clear()
        beat.join()
        policy.close()


def test_many_threads_lose_no_launch(fake_cuda, tmp_path):
    """Launches from several threads of one tenant while the controller flips the gate."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            policy.heartbeat()
            policy.set_gate(0b01)
            time.sleep(0.002)
            policy.set_gate(0b11)
            time.sleep(0.002)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        log = tmp_path / "log"
        script = (
            "import ctypes, threading\n"
            "cuda = ctypes.CDLL('libcuda.so.1')\n"
            "U = ctypes.c_uint\n"
            "def run(t):\n"
            "    for i in range(200):\n"
            "        assert cuda.cuLaunchKernel(None, U(t * 1000 + i), U(1), U(1), U(1), U(1), U(1), U(0),"
            " ctypes.c_void_p(t + 1), None, None) == 0\n"
            "ts = [threading.Thread(target=run, args=(t,)) for t in range(4)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n")
        env = child_env(fake_cuda, log, tenant="b", ledger=policy.prefix)
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
        rows = read_log(log)
        assert len(rows) == 800
        for t in range(4):  # per stream (one per thread): all there, in order
            assert [q for _, s, q in rows if s == t + 1] == [t * 1000 + i for i in range(200)]
    finally:
        stop.set()
        flipper.join()
        policy.close()


def test_launches_being_captured_into_a_graph_record_no_events(fake_cuda, tmp_path):
    """An event recorded in a capture would become a graph node, and waiting on it would break the
    capture: captured launches pass through untimed (the graph is timed when replayed)."""
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 1.0)])
    try:
        script = (
            "import ctypes, json, time\n"
            "cuda = ctypes.CDLL('libcuda.so.1')\n"
            "U = ctypes.c_uint\n"
            "for stream, micros in ((99, 5), (1, 7)):\n"
            "    for i in range(10):\n"
            "        assert cuda.cuLaunchKernel(None, U(i), U(1), U(1), U(micros), U(1), U(1), U(0),"
            " ctypes.c_void_p(stream), None, None) == 0\n"
            "out = (ctypes.c_uint64 * 8)()\n"
            "deadline = time.monotonic() + 5\n"
            "while time.monotonic() < deadline:\n"
            "    ctypes.CDLL(None).gpuscope_share_stats(out)\n"
            "    if out[4] >= 70000 * 0.99:\n"
            "        break\n"
            "    time.sleep(0.01)\n"
            "print(json.dumps(list(out)))\n")
        env = child_env(fake_cuda, tmp_path / "log", tenant="a", ledger=policy.prefix)
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True, timeout=60)
        stats = json.loads(run.stdout)
        assert stats[0] == 20  # all launched and counted
        assert stats[4] == pytest.approx(70_000, rel=0.01)  # only stream 1's 10 × 7 µs were timed
        assert len(read_log(tmp_path / "log")) == 20
    finally:
        policy.close()


def test_a_forked_child_joins_with_its_own_page_and_leaves_the_parents(fake_cuda, tmp_path):
    policy = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 1.0)])
    joined = Joined(policy)
    try:
        script = (
            "import ctypes, os, json, sys\n"
            "cuda = ctypes.CDLL('libcuda.so.1')\n"
            "U = ctypes.c_uint\n"
            "def launch():\n"
            "    assert cuda.cuLaunchKernel(None, U(0), U(1), U(1), U(1), U(1), U(1), U(0),"
            " ctypes.c_void_p(1), None, None) == 0\n"
            "launch()\n"
            "parent = os.getpid()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    launch()\n"
            "    sys.exit(0)\n"  # a normal exit: the atexit handlers inherited from the parent run
            "os.waitpid(pid, 0)\n"
            "sys.stdin.readline()\n"  # the test looks at the joins while the parent still runs
            "launch()\n"
            "out = (ctypes.c_uint64 * 8)()\n"
            "ctypes.CDLL(None).gpuscope_share_stats(out)\n"
            "print(json.dumps([parent, pid, out[6], out[7]]), flush=True)\n")
        env = child_env(fake_cuda, tmp_path / "log", tenant="a", ledger=policy.prefix)
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        kinds = ["join", "join", "leave"]
        wait_for(lambda: joined.poll() is not None and [k for k, _ in joined.events] == kinds,
                 what="parent and child to join, and the child to leave")
        parent_joined, child_joined, child_left = (pid for _, pid in joined.events)
        assert parent_joined == proc.pid and child_left == child_joined != parent_joined
        out, err = proc.communicate("go\n", timeout=60)
        parent, child, failed_open, still_joined = json.loads(out)
        assert (parent, child) == (parent_joined, child_joined)
        assert failed_open == 0 and still_joined == 1, err  # the child's exit left the parent's connection
        wait_for(lambda: joined.poll() is not None and joined.events[-1] == ("leave", parent),
                 what="the parent's exit")
    finally:
        joined.close()
        policy.close()
