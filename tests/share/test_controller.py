"""The controller with real tenant processes on the fake driver: join, crash, binding, metrics, CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuscope.contract import catalogue
from gpuscope.share.controller import LONE_JUDGE_S, STARVED_JUDGE_S, Controller
from gpuscope.share.ledger import HELPER_WAKE_REASONS, TenantPolicy
from gpuscope.share.main import main as share_main
from gpuscope.share.metrics import ShareCollector
from gpuscope.share.policy import parse_shares
from gpuscope.share.settings import (
    STARVED_TURNS_S,
    SUGGESTED_STARVED_BELOW,
    Handover,
    LoneHolder,
    ShareSettings,
    Turns,
)
from tests.conftest import wait_for as shared_wait_for
from tests.share.fakecuda import child_env, helper_folder, running_controller

# A fake tenant's program. Its sleeps are its workload, not waits of the test: it polls the clock
# until the common start time, an 'idle' tenant stops launching after 10 kernels (the test ends it),
# a 'light' one spaces its kernels 2 ms apart, and a 'gpu' one launches kernels of 2 ms (on a GPU that
# runs them in wall time: what it gets is GPU time, not the CPU a busy host leaves it).
LOOP = """
import ctypes, sys, time
cuda = ctypes.CDLL('libcuda.so.1'); U = ctypes.c_uint
start = float(sys.argv[3])  # tenants compared start together, however late each process came up
while time.time() < start:
    time.sleep(0.001)
end = max(start, time.time()) + float(sys.argv[1])
n = 0
light = sys.argv[2] == 'light'  # 5 µs kernels 2 ms apart: a latency-bound tenant
while time.time() < end:
    kernel_us = 5 if light else 2000 if sys.argv[2] == 'gpu' else 50
    cuda.cuLaunchKernel(None, U(n), U(1), U(1), U(kernel_us), U(1), U(1), U(0), ctypes.c_void_p(1),
                        None, None)
    n += 1
    if sys.argv[2] == 'idle' and n == 10:
        time.sleep(60)
    if light:
        time.sleep(0.002)
"""


def tenant(fake, tmp_path, name: str, ledger: str, seconds: float, how: str = "busy",
           start_at: float = 0.0) -> subprocess.Popen:
    """A tenant process launching for ``seconds`` from ``start_at`` (``time.time()``; 0: at once)."""
    env = child_env(fake, tmp_path / f"log-{name}", tenant=name, ledger=ledger)
    env["FAKE_CUDA_LOG"] = os.devnull
    if how == "gpu":  # the test's tenants share one GPU that runs in wall time
        env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_SHARED_GPU=str(tmp_path / "gpu"))
    return subprocess.Popen([sys.executable, "-c", LOOP, str(seconds), how, str(start_at)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    shared_wait_for(predicate, timeout=timeout, interval=0.01, what=what)


def running(ledger: str, tenants: list[TenantPolicy], handover: Handover = Handover.OVERLAP,
            turns: Turns = Turns.C):
    return running_controller(ledger, tenants, slice=0.01, drain_timeout=2.0,  # CI's slack
                              handover=handover, turns=turns)


@pytest.fixture(params=["drain", "drain-python", "overlap", "overlap-python"])
def controller(tmp_path, request):
    """Draining and overlapping hand-overs, decided in C (the turn keeper, where built) or in Python."""
    handover, _, where = request.param.partition("-")
    with running(str(tmp_path / "ledger"), [TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)],
                 Handover(handover), Turns.PYTHON if where == "python" else Turns.C) as c:
        yield c


def test_a_crashed_process_gives_its_share_back(fake_cuda, tmp_path, controller):
    p = tenant(fake_cuda, tmp_path, "a", controller.policy.prefix, 30, "idle")
    try:
        wait_for(lambda: p.pid in controller.procs, what="the controller to adopt the process")
        wait_for(lambda: controller.procs[p.pid].view.counter("launches") == 10, what="its launches")
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        wait_for(lambda: p.pid not in controller.procs, what="the dead process to be forgotten")
        assert controller.policy.joins.results["left"] == 1  # its connection ended with it
        assert controller.stats.departed["a"]["launches"] == 10
    finally:
        p.kill()
        p.wait()


@contextlib.contextmanager
def tenants_a_and_b(fake, tmp_path, controller, how: str = "busy", seconds: float = 2.0):
    """Tenants a and b launching over the same ``seconds`` (one that came up late on a busy machine
    would otherwise find the other alone on the GPU, shares not binding, and compare less time at its
    share); the block's end waits for both to exit cleanly, and for the controller to notice."""
    start_at = time.time() + 1.0
    procs = [tenant(fake, tmp_path, name, controller.policy.prefix, seconds, how, start_at=start_at)
             for name in "ab"]
    try:
        yield procs
        for p in procs:
            _, err = p.communicate(timeout=30)
            assert p.returncode == 0 and err == ""
    finally:
        for p in procs:
            p.kill()
            p.wait()
    wait_for(lambda: set(controller.stats.departed) == {"a", "b"}, what="both exits to be noticed")


def test_two_busy_tenants_are_sliced_and_both_progress(fake_cuda, tmp_path, controller):
    seen = {}
    with tenants_a_and_b(fake_cuda, tmp_path, controller) as procs:
        wait_for(lambda: all(p.pid in controller.procs for p in procs), what="both tenants")
        wait_for(lambda: controller.stats.binding, what="shares to bind")
        for p in procs:
            seen[p.pid] = controller.procs[p.pid].view.counters()
    assert controller.stats.slices["a"] > 0 and controller.stats.slices["b"] > 0
    assert controller.stats.drain_timeouts == 0
    if controller.handover == "drain" and controller.keeper:
        assert controller.stats.yields > 0  # holders stopped at their slices' ends by themselves
    assert all(c["launches"] > 0 for c in seen.values())
    # both were held at the gate for the other's turns
    a, b = (controller.stats.departed[n] for n in "ab")
    assert a["throttled_ns"] > 0 and b["throttled_ns"] > 0
    # both had the (fake) GPU. Which had more is the next test's: on this GPU, which takes no time,
    # each gets the GPU time it launches in the CPU the host leaves it, whatever its share (two test
    # workers on two cores left the 0.7 tenant less than the 0.3 one)
    assert a["gpu_ns"] > 0 and b["gpu_ns"] > 0


def test_the_larger_share_gets_more_of_a_gpu_that_takes_time(fake_cuda, tmp_path, controller):
    with tenants_a_and_b(fake_cuda, tmp_path, controller, "gpu"):
        pass
    # each launch is 2 ms of the one GPU's wall time: the larger share ran more of them
    a, b = (controller.stats.departed[n]["launches"] for n in "ab")
    assert a > b > 0, (a, b, controller.stats)


def test_a_higher_priority_tenant_within_its_share_runs_beside_the_holder(fake_cuda, tmp_path):
    tenants = [TenantPolicy("batch", 0.7), TenantPolicy("online", 0.3, priority=1)]
    with running(str(tmp_path / "ledger"), tenants) as c:
        started = time.monotonic()
        hog = tenant(fake_cuda, tmp_path, "batch", c.policy.prefix, 5)
        online = tenant(fake_cuda, tmp_path, "online", c.policy.prefix, 5, "light")
        try:
            wait_for(lambda: c.stats.binding and c.beside == {1}, what="online to run beside the holder")
            assert c.policy.beside_mask == 0b10  # it launches untimed
            assert c.policy.gate & 0b11 == 0b11  # the holder and the tenant beside it both launch
            # a probe pauses the holder and measures the busy fraction of the tenant beside it (a 20 ms
            # probe on a busy machine may see none of its launches, 2 ms apart when sleeps keep time:
            # probes come every second, and their running estimate takes the next one that does)
            wait_for(lambda: c.prober.busy_ratio.get(1, 0.0) > 0, what="a probe's busy fraction")
            assert c.stats.probes >= 1
            # from then on its launches beside are charged its probed kernel time each (before its
            # first probe that saw a launch, nothing: on a busy machine that probe may come late)
            wait_for(lambda: c.stats.charged_s["online"] > 0, what="a charge for its launches beside")
            # 5 µs kernels about 2 ms apart (sleeps overshoot on a busy machine): about 0.25% busy
            assert c.prober.busy_ratio[1] < 0.01
            # the hog is probed too (one tenant a probe, with online running beside it): it keeps the
            # GPU busy, so it takes turns and never runs beside
            wait_for(lambda: 0 in c.prober.busy_ratio, what="the hog's probe")
            assert c.prober.busy_ratio[0] > 0.5 and 0 not in c.beside
            for p in (hog, online):
                _, err = p.communicate(timeout=30)
                assert p.returncode == 0 and err == ""
        finally:
            for p in (hog, online):
                p.kill()
                p.wait()
        wait_for(lambda: set(c.stats.departed) == {"batch", "online"}, what="both exits to be noticed")
        wall = time.monotonic() - started
        # what the processes posted while running at once is scaled down to the wall time
        assert sum(c.stats.charged_s.values()) <= wall
        online_counters = c.stats.departed["online"]
        assert online_counters["launches"] > 0 and online_counters["waits"] == 0  # never held at the gate
        # only the probes timed its launches one by one, and the holder's only in its own probes
        assert 0 < online_counters["busy_launches"] < online_counters["launches"]
        batch_counters = c.stats.departed["batch"]
        assert 0 < batch_counters["busy_launches"] < batch_counters["launches"]
        # charged its measured busy fraction of the time it ran beside, not the gaps between kernels
        assert 0 < c.stats.charged_s["online"] <= 0.01 * wall
        assert c.stats.charged_s["batch"] > c.stats.charged_s["online"]


@pytest.mark.parametrize("lone_holder", [LoneHolder.HOLD, LoneHolder.DUTY])
def test_the_lone_holder_is_given_a_duty_only_where_asked(tmp_path, lone_holder):
    tenants = [TenantPolicy("train", 0.5), TenantPolicy("encoder", 0.3), TenantPolicy("mlp", 0.2)]
    c = Controller(str(tmp_path / "ledger"), tenants, ShareSettings(lone_holder=lone_holder))
    try:
        registry = CollectorRegistry()
        registry.register(ShareCollector(c))
        # training and the MLP idle the GPU most of the time and run beside; the encoder takes turns
        c.beside, c.prober.busy_ratio = {0, 2}, {0: 0.45, 1: 0.85, 2: 0.25}
        c._set_duties({0, 1, 2})
        expected = 0.3 / 0.85 if lone_holder == LoneHolder.DUTY else 1.0
        assert c.policy.duty(1) == pytest.approx(expected, rel=0.01)
        assert c.policy.duty(0) == 1.0 and c.policy.duty(2) == 1.0  # within their shares
        shown = [ln for ln in generate_latest(registry).decode().splitlines()
                 if ln.startswith('gpuscope_share_duty_ratio{gpu="0",tenant="encoder",uuid=""}')]
        assert [float(ln.split()[-1]) for ln in shown] == ([pytest.approx(expected, rel=0.01)]
                                                          if lone_holder == LoneHolder.DUTY else [])
        if lone_holder == LoneHolder.DUTY:
            # a second on: 200 launches a second of 1 ms kernels, where alone it kept the GPU busy
            # 85% of the time, is 0.235 of its alone rate: under its 0.3, so it gets more of the time
            c.prober.launch_s = {1: 1e-3}
            c._lone_mark = (1, time.monotonic() - LONE_JUDGE_S - 0.2, 0)
            c.processes.launches = lambda slot: 240 if slot == 1 else 0
            c._set_duties({0, 1, 2})
            assert c.lone_throughput == pytest.approx(0.235, rel=0.1)
            assert c.policy.duty(1) > expected * 1.2
        # a second tenant takes turns: they hand the GPU to each other, and no duty holds the encoder
        c.beside = {2}
        c._set_duties({0, 1, 2})
        assert c.policy.duty(1) == 1.0
        # one moved to turns because it was starved beside the holder is not held back as the lone one
        c.beside, c.to_turns = {0, 2}, {1: time.monotonic() + 30}
        c._set_duties({0, 1, 2})
        assert c.policy.duty(1) == 1.0
    finally:
        c.close()


def test_a_tenant_beside_the_holder_over_its_share_is_given_a_duty(tmp_path):
    c = Controller(str(tmp_path / "ledger"), [TenantPolicy("batch", 0.7), TenantPolicy("online", 0.3, 1)])
    try:
        registry = CollectorRegistry()
        registry.register(ShareCollector(c))
        c.beside, c.prober.busy_ratio = {1}, {1: 0.4}  # its probes: busy 40% of the time, on a 30% share
        # and its launches were charged as much lately (decayed GPU seconds: a rate times the memory)
        c.scheduler.charge(1, 0.4 * c.scheduler.memory_s, time.monotonic())
        c._set_duties({0, 1})
        assert c.policy.duty(1) == pytest.approx(0.75, rel=0.01) and c.policy.duty(0) == 1.0
        shown = [ln for ln in generate_latest(registry).decode().splitlines()
                 if ln.startswith('gpuscope_share_duty_ratio{gpu="0",tenant="online",uuid=""}')]
        assert len(shown) == 1 and float(shown[0].split()[-1]) == pytest.approx(0.75, rel=0.01)
        # charged under its share at that duty (an open loop whose requests need less than its probe
        # showed): launches all the time again
        c.scheduler.used[1] = 0.15 * c.scheduler.memory_s
        c._set_duties({0, 1})
        assert c.policy.duty(1) == 1.0
        c.scheduler.used[1] = 0.4 * c.scheduler.memory_s
        c.prober.busy_ratio = {1: 0.2}  # fits: launches all the time again
        c._set_duties({0, 1})
        assert c.policy.duty(1) == 1.0
        c.prober.busy_ratio, c.beside = {1: 0.4}, set()  # taking turns: the gate holds it, not a duty
        c._set_duties({0, 1})
        assert c.policy.duty(1) == 1.0
    finally:
        c.close()


def test_a_probe_drains_the_tenants_it_pauses_beside_the_holder_too(tmp_path):
    """Paused for another tenant's probe, a tenant beside the holder is drained like a turn-taker (its
    queued kernels would run through the probe, timed as the probed tenant's); one of higher priority
    than the probed tenant keeps running, and is not waited for."""
    tenants = [TenantPolicy("batch", 0.5), TenantPolicy("train", 0.2), TenantPolicy("online", 0.3, 1)]
    c = Controller(str(tmp_path / "ledger"), tenants)
    drains: list[tuple[set[int], int | None]] = []
    c._drain = lambda slots, running=None: drains.append((set(slots), running))
    try:
        c.beside = {1, 2}  # the training loop and the latency tenant beside the batch holder
        c._start_probe(0)
        assert drains[-1] == ({1}, 0b101)  # the latency tenant runs on through the batch's probe
        c.prober.stop()
        c._start_probe(2)
        assert drains[-1] == ({0, 1}, 0b100)
    finally:
        c.prober.stop()
        c.close()


def test_time_posted_while_the_gate_is_open_is_not_held_against_a_tenant(tmp_path):
    tenants = [TenantPolicy("batch", 0.7), TenantPolicy("online", 0.3, priority=1)]
    c = Controller(str(tmp_path / "ledger"), tenants)
    try:
        assert c.policy.gate & 0xFFFF == 0xFFFF  # nothing binds yet
        c.charger._apply({0: 0.5, 1: 0.5}, time.monotonic(), None, gate_open=True)  # posted side by side
        assert c.stats.charged_s == {"batch": 0.5, "online": 0.5}  # shown in /metrics
        assert c.scheduler.used == [0.0, 0.0]  # but the online tenant starts within its share
        assert c.scheduler.beside({0, 1}) == {1}
    finally:
        c.close()


def test_metrics_come_from_the_catalogue(fake_cuda, tmp_path, controller):
    p = tenant(fake_cuda, tmp_path, "b", controller.policy.prefix, 30, "idle")
    try:
        wait_for(lambda: p.pid in controller.procs, what="the tenant")
        wait_for(lambda: controller.procs[p.pid].view.counter("launches") == 10, what="its launches")
        registry = CollectorRegistry()
        registry.register(ShareCollector(controller))
        text = generate_latest(registry).decode()
    finally:
        p.kill()
        p.wait()
    assert f'gpuscope_share_launches_total{{gpu="0",pid="{p.pid}",tenant="b",uuid=""}} 10.0' in text
    # it describes what it collects, so a registry refuses a second collector with one of its names
    collected = {f.name for f in ShareCollector(controller).collect()}
    assert {f.name for f in ShareCollector(controller).describe()} == collected
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(ShareCollector(controller))
    assert 'gpuscope_share_target_ratio{gpu="0",tenant="a",uuid=""} 0.7' in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    for name in names:
        base = name.removesuffix("_created")
        assert base in {m.name for m in catalogue.all_metrics()}, name


def test_share_flags():
    assert parse_shares("online=0.3:5, batch=0.7") == [TenantPolicy("online", 0.3, 5),
                                                       TenantPolicy("batch", 0.7)]
    for bad, why in (("a=0.8,b=0.3", "more than 1"), ("a", "NAME=FRACTION"), ("a=x", "must be a number"),
                     ("a=0", "(0, 1]"), ("a=0.1,a=0.2", "twice"), ("a b=0.1", "tenant name"),
                     ("", "no tenants")):
        with pytest.raises(ValueError) as info:
            parse_shares(bad)
        assert why in str(info.value), (bad, str(info.value))


def test_a_bad_flag_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        share_main(["--share", "a=2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpuscope share: error:" in err and "(0, 1]" in err
    with pytest.raises(SystemExit) as info:
        share_main(["--share", "a=0.5", "--share.accounting", "smi"])
    assert info.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:  # probes that would pause the holder a fifth of the time
        share_main(["--share", "a=0.5", "--share.probe-every", "50ms"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--share.probe-every must be at least 0.15s" in err
    with pytest.raises(SystemExit) as info:
        share_main(["--share", "a=0.5", "--share.probe-backoff", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--share.probe-backoff must be between 1 and 64, not 0" in err
    for bad in ("1", "-0.1", "most"):
        with pytest.raises(SystemExit) as info:
            share_main(["--share", "a=0.5", "--share.starved-below", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--share.starved-below" in err, err


def test_the_command_serves_metrics_and_cleans_up_on_sigterm(tmp_path):
    import urllib.request

    from gpuscope.util.freeport import free_port

    port = free_port()
    ledger = str(tmp_path / "ledger")
    env = {**os.environ, "GPUSCOPE_SHARE": "online=0.3:1,batch=0.7"}  # the flag from its env var
    proc = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "share", "--share.ledger", ledger,
                             "--web.listen-address", f"127.0.0.1:{port}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def scraped() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    return r.read().decode()
            except OSError:
                return ""

        wait_for(lambda: proc.poll() is not None or "gpuscope_share_target_ratio" in scraped(),
                 what="the controller's /metrics")
        assert proc.poll() is None, proc.communicate()[1]
        text = scraped()
        assert 'gpuscope_share_target_ratio{gpu="0",tenant="online",uuid=""} 0.3' in text
        assert os.path.exists(ledger + ".sock") and os.path.exists(ledger + ".lock")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert not os.path.exists(ledger + ".sock") and not os.path.exists(ledger + ".lock")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_tenant_starved_beside_the_holder_takes_turns_for_a_while(tmp_path):
    tenants = [TenantPolicy("encoder", 0.5), TenantPolicy("mlp", 0.2), TenantPolicy("online", 0.3, 1)]
    c = Controller(str(tmp_path / "ledger"), tenants, ShareSettings(starved_below=SUGGESTED_STARVED_BELOW))
    try:
        registry = CollectorRegistry()
        registry.register(ShareCollector(c))
        waited_ns = {0: 0, 1: 0, 2: 0}  # each tenant's processes' time in waits for the GPU
        c.processes.sync_wait_ns = waited_ns.get
        now = time.monotonic()
        active = {0, 1, 2}
        # the MLP's probes read it busy 0.3 of the time and waiting for the GPU a third of it: beside
        # the encoder, which takes turns
        c.prober.busy_ratio = {0: 0.9, 1: 0.3, 2: 0.1}
        c.prober.wait_ratio = {0: 0.9, 1: 1 / 3, 2: 0.1}
        c._set_beside(c.scheduler.beside(active, c.prober.busy_ratio), now)
        assert c.beside == {1, 2}
        # there it waits 0.92 of its time (0.12 of its alone rate, on a fair share of 0.2); the latency
        # tenant waits a little more than alone. Too soon to judge either
        waited_ns[1], waited_ns[2] = int(0.92 * 1e9), int(0.15 * 1e9)
        assert c._move_starved(active, now + 1) == set()
        waited_ns[1], waited_ns[2] = int(0.92 * STARVED_JUDGE_S * 1e9), int(0.15 * STARVED_JUDGE_S * 1e9)
        # beside long enough: the MLP takes turns; the latency tenant, beside by its priority, stays
        later = now + STARVED_JUDGE_S
        assert c._move_starved(active, later) == {1}
        c._set_beside(c.scheduler.beside(active, c.prober.busy_ratio, c.beside, {1}), later)
        assert c.beside == {2}

        def shown(name: str) -> dict[str, float]:
            return {ln.split('tenant="')[1].split('"')[0]: float(ln.split()[-1])
                    for ln in generate_latest(registry).decode().splitlines() if ln.startswith(name + "{")}

        assert shown("gpuscope_share_starved_beside_total") == {"encoder": 0.0, "mlp": 1.0, "online": 0.0}
        # the latency tenant's estimate is still shown (0.85 / 0.9 of its alone rate), the MLP's no longer
        assert shown("gpuscope_share_beside_throughput_ratio") == pytest.approx({"online": 0.85 / 0.9})
        # for STARVED_TURNS_S, then its probes decide again
        assert c._move_starved(active, later + STARVED_TURNS_S - 1) == {1}
        assert c._move_starved(active, later + STARVED_TURNS_S + 1) == set()
        # beside again: not judged while a duty holds it back (over its share, its waits are the
        # duty's), nor when nobody takes turns beside it
        again = later + STARVED_TURNS_S + 1
        c._set_beside({1, 2}, again)
        waited_ns[1] += int(0.92 * STARVED_JUDGE_S * 1e9)
        judged = again + STARVED_JUDGE_S
        c.duty[1] = 0.5
        assert c._move_starved(active, judged) == set()
        c.duty[1] = 1.0
        assert c._move_starved({1, 2}, judged) == set()
        assert c._move_starved(active, judged) == {1}
        # on a host short of CPU its steps slow, but it waits less of its time than alone: not starved
        c._set_beside({2}, judged)
        c.to_turns.clear()
        c._set_beside({1, 2}, judged)
        waited_ns[1] += int(0.2 * STARVED_JUDGE_S * 1e9)
        assert c._move_starved(active, judged + STARVED_JUDGE_S) == set()
        assert c.beside_throughput[1] == pytest.approx(0.8 / (2 / 3))
    finally:
        c.close()


def _voluntary_switches(task: str) -> int:
    with open(f"{task}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def test_each_helper_wake_up_is_counted_by_what_it_slept_on(fake_cuda, tmp_path):
    """The helper thread's wake-ups by reason add up to what the kernel counts for that thread (its
    voluntary context switches), its CPU is shown, and /metrics serves both per process."""
    # launching for longer than the test reads them (a busy host may start one late)
    with (running(str(tmp_path / "ledger"), [TenantPolicy("a", 0.7), TenantPolicy("b", 0.3)],
                  Handover.DRAIN) as c,
          tenants_a_and_b(fake_cuda, tmp_path, c, "gpu", seconds=6.0) as procs):
        wait_for(lambda: all(p.pid in c.procs for p in procs), what="both tenants")
        wait_for(lambda: c.stats.slices["a"] >= 2 and c.stats.slices["b"] >= 2, what="turns taken")
        registry = CollectorRegistry()
        registry.register(ShareCollector(c))
        for p in procs:
            task = helper_folder(p.pid)
            assert task is not None
            switches = _voluntary_switches(task)
            counters = c.procs[p.pid].view.counters()
            counted = sum(counters[f"helper_wakes_{reason}"] for reason in HELPER_WAKE_REASONS)
            # read a moment apart, and a sleep that did not block (the gate changed as it began) is
            # counted without a switch: close, not equal
            assert abs(counted - switches) <= max(5, 0.2 * switches), (counted, switches, counters)
            # taking turns, it waited on its windows' end events and on the gate
            assert counters["helper_wakes_window"] + counters["helper_wakes_gate"] > 0
            with open(f"{task}/schedstat") as f:
                thread_cpu_ns = int(f.read().split()[0])
            assert 0 < counters["helper_cpu_ns"] <= thread_cpu_ns
        text = generate_latest(registry).decode()
        for p, name in zip(procs, "ab", strict=True):
            for reason in HELPER_WAKE_REASONS:
                assert (f'gpuscope_share_helper_wakeups_total{{gpu="0",pid="{p.pid}",reason="{reason}",'
                        f'tenant="{name}",uuid=""}}') in text
            cpu = f'gpuscope_share_helper_cpu_seconds_total{{gpu="0",pid="{p.pid}",tenant="{name}"'
            assert cpu in text
