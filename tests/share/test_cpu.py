"""What the controller and the tenants' helper threads wake for, counted rather than timed: each
wake-up costs CPU (a wake-up of a helper about 10 µs on the CPU host, more under the H200's VM), so
the tests bound how often they come, never how fast anything runs."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpuscope.share.gpus import Gpu
from gpuscope.share.ledger import TenantPolicy
from gpuscope.share.node import Node
from gpuscope.share.policy import PolicySpec
from gpuscope.share.unmanaged import BACKOFF, UnmanagedWatch
from tests.conftest import wait_for
from tests.share.fakecuda import HERE, child_env, helper_folder, running_controller

GiB = 1 << 30


def test_the_watch_looks_less_often_while_the_gpus_processes_stay_the_same():
    on_gpu = {101: GiB}
    watch = UnmanagedWatch(lambda: on_gpu, lambda: {101}, interval_s=0.25)
    intervals = []
    for _ in range(5):
        watch.sample()
        intervals.append(watch.interval_s)
    assert intervals == [0.25, 0.5, 1.0, 1.0, 1.0] and BACKOFF == 4


def test_the_watch_looks_again_at_its_interval_after_a_change_and_reports_a_newcomer_at_the_second_look():
    on_gpu = {101: GiB}
    joined = {101}
    watch = UnmanagedWatch(lambda: on_gpu, lambda: joined, interval_s=0.25)
    for _ in range(4):
        watch.sample()
    assert watch.interval_s == 1.0
    on_gpu[102] = GiB  # a process that never joins: seen at the next look, at most BACKOFF intervals on
    watch.sample()
    assert watch.unmanaged == {} and watch.interval_s == 0.25  # seen once: looked at again soon
    watch.sample()
    assert watch.unmanaged == {102: GiB} and watch.interval_s == 0.5  # reported: nothing new since
    del on_gpu[102]
    watch.sample()
    assert watch.unmanaged == {} and watch.interval_s == 0.25  # a process went: a change too
    on_gpu[103] = GiB
    joined.add(103)  # a tenant that joined is a change of the list as well
    watch.sample()
    assert watch.interval_s == 0.25


def test_the_watch_thread_sleeps_the_longer_interval():
    """Lower bounds only: a busy machine can only make the gaps longer."""
    seen: list[float] = []

    def source() -> dict[int, int]:
        seen.append(time.monotonic())
        return {101: GiB}

    watch = UnmanagedWatch(source, lambda: {101}, interval_s=0.02)
    watch.start()
    try:
        wait_for(lambda: len(seen) >= 7, what="seven samples")
    finally:
        watch.stop()
    gaps = [b - a for a, b in itertools.pairwise(seen)]
    assert all(gap >= 0.02 * BACKOFF * 0.9 for gap in gaps[3:6]), gaps  # backed off after three


def voluntary_switches(tid_folder: str) -> int:
    with open(f"{tid_folder}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def test_the_node_thread_sleeps_between_policy_checks(tmp_path):
    spec = PolicySpec([TenantPolicy("a", 1.0)], {})
    node = Node(str(tmp_path / "ledger"), [Gpu(0, "")], spec, log=lambda line: None)
    stop = threading.Event()
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        node.run(stop)

    loop = threading.Thread(target=run)
    loop.start()
    try:
        wait_for(lambda: tid, what="the node's thread")
        folder = f"/proc/self/task/{tid[0]}"
        before, t0 = voluntary_switches(folder), time.monotonic()
        wait_for(lambda: time.monotonic() - t0 >= 1.5, what="a second and a half")
        woke, seconds = voluntary_switches(folder) - before, time.monotonic() - t0
        # twice a second, and a switch now and then for the GIL on a busy machine (it was 20 a second)
        assert woke < 10 * seconds, (woke, seconds)
    finally:
        stop.set()
        node.nudge()
        loop.join()
        node.close()


def graph_launches(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.startswith("cuGraphLaunch"))


def test_a_holder_that_replays_a_graph_and_syncs_every_step_does_not_wake_its_helper_at_each(
        fake_cuda, tmp_path):
    """A replayed graph synced every step launches again at once after each wait: it is never quiet,
    so its waits need not wake its helper (they did, one wake-up a step). It takes turns with a
    GPU-bound tenant; its helper's wake-ups are counted against its steps over two seconds."""
    gpu, log = tmp_path / "gpu", tmp_path / "graph.log"
    tenants = [TenantPolicy("graph", 0.5), TenantPolicy("hog", 0.5)]
    with running_controller(str(tmp_path / "ledger"), tenants) as c:
        procs = []
        for kind, tenant, calls in (("replay", "graph", log), ("busy", "hog", Path(os.devnull))):
            env = child_env(fake_cuda, calls, tenant=tenant, ledger=c.policy.prefix)
            env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_SHARED_GPU=str(gpu), FAKE_CUDA_GRAPH_US="500")
            procs.append(subprocess.Popen([sys.executable, str(HERE / "workload.py"), kind, "8"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            folder = wait_for(lambda: helper_folder(procs[0].pid), what="the graph tenant's helper")
            wait_for(lambda: c.stats.binding and sum(c.stats.slices.values()) > 4, what="turns")
            woke0, steps0, t0 = voluntary_switches(folder), graph_launches(log), time.monotonic()
            wait_for(lambda: time.monotonic() - t0 >= 2.0, what="two seconds")
            woke, steps = voluntary_switches(folder) - woke0, graph_launches(log) - steps0
        finally:
            for p in procs:
                p.kill()
                p.wait()
    assert steps > 100, steps  # it ran, in its turns
    # about one wake-up every 10 ms while it holds the GPU, and a few a hand-over: far fewer than steps
    assert woke < steps / 4, (woke, steps)


def test_a_borrowers_helper_sleeps_through_the_lent_turns_first_windows(fake_cuda, tmp_path):
    """A training-like tenant (3 ms of kernels, a sync, 1 ms on the host: busy about 3/4, so it takes
    turns) lends the rest of its turn at each step's sync to a GPU-bound tenant and takes it back at
    its next launch. The borrower's launching thread posts its windows at the lent turn's short queue,
    so its helper wakes for the reclaim's drain, not for the lent turn's first window (it did, and
    napped: on the CPU host about 4.5 wake-ups a lend here, 3.4 without). Counted over two seconds
    against the lends."""
    gpu = tmp_path / "gpu"
    tenants = [TenantPolicy("train", 0.7), TenantPolicy("hog", 0.3)]
    with running_controller(str(tmp_path / "ledger"), tenants) as c:
        procs = []
        for kind, tenant in (("steps", "train"), ("busy", "hog")):
            env = child_env(fake_cuda, Path(os.devnull), tenant=tenant, ledger=c.policy.prefix)
            env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_SHARED_GPU=str(gpu), WORKLOAD_GAP_MS="1")
            procs.append(subprocess.Popen([sys.executable, str(HERE / "workload.py"), kind, "8"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            folder = wait_for(lambda: helper_folder(procs[1].pid), what="the borrower's helper")
            wait_for(lambda: c.stats.lends > 50, what="lent turns")
            woke0, lends0, t0 = voluntary_switches(folder), c.stats.lends, time.monotonic()
            wait_for(lambda: time.monotonic() - t0 >= 2.0, what="two seconds")
            woke, lends = voluntary_switches(folder) - woke0, c.stats.lends - lends0
        finally:
            for p in procs:
                p.kill()
                p.wait()
    assert lends > 50, lends  # it lent its turns
    # the reclaim's drain wakes it twice (the gate closes, then its last window finishes), and the
    # launching thread's waits on the queue now and then
    assert woke < 3.9 * lends, (woke, lends)


def test_a_holder_with_only_a_latency_tenant_beside_it_posts_its_windows_in_batches(fake_cuda, tmp_path):
    """Nobody takes turns but the holder (the latency tenant beside it never waits for its hand-over
    or for a lent turn), so its helper posts the finished windows every 25 ms instead of waking for
    each and looking for quiet every millisecond: here about 1,800 wake-ups a second before, about 40
    now."""
    gpu = tmp_path / "gpu"
    tenants = [TenantPolicy("hog", 0.7), TenantPolicy("llm", 0.3, priority=1)]
    with running_controller(str(tmp_path / "ledger"), tenants) as c:
        procs = []
        for kind, tenant in (("busy", "hog"), ("steps", "llm")):
            env = child_env(fake_cuda, Path(os.devnull), tenant=tenant, ledger=c.policy.prefix)
            env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_SHARED_GPU=str(gpu))
            if tenant == "llm":  # a request: a few short kernels, then the host until the next one
                env.update(WORKLOAD_BURST="5", WORKLOAD_KERNEL_US="50", WORKLOAD_GAP_MS="5")
            procs.append(subprocess.Popen([sys.executable, str(HERE / "workload.py"), kind, "8"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            folder = wait_for(lambda: helper_folder(procs[0].pid), what="the holder's helper")
            wait_for(lambda: c.stats.binding and c.policy.beside_mask == 0b10,
                     what="the latency tenant beside")
            woke0, t0 = voluntary_switches(folder), time.monotonic()
            wait_for(lambda: time.monotonic() - t0 >= 2.0, what="two seconds")
            woke, seconds = voluntary_switches(folder) - woke0, time.monotonic() - t0
            beside = c.policy.beside_mask
        finally:
            for p in procs:
                p.kill()
                p.wait()
    assert beside == 0b10, bin(beside)  # still beside: the holder took no turns with it
    assert woke < 75 * seconds, (woke, seconds)  # 40 a second, and a few at gate changes (100 at 10 ms)
