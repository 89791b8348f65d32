"""Memory caps against the fake driver: every allocation path is held to the tenant's cap (as a
whole, across its processes), frees and crashes give memory back, the out-of-memory code is the
driver's, and cuMemGetInfo and NVML show the cap as the card."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuscope.share.crosscheck import ReportCheck
from gpuscope.share.ledger import TenantPolicy
from gpuscope.share.metrics import ShareCollector
from gpuscope.share.policy import parse_memory, parse_shares
from gpuscope.share.unmanaged import UnmanagedWatch
from tests.conftest import wait_for
from tests.share.fakecuda import Tenant, running_controller
from tests.share.hostile import join

MiB, GiB = 2**20, 2**30
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
CARD = 80 * GiB  # the fake driver's and fake NVML's card
ROUTES = ["symbol", "gpa", "pitch", "managed", "async", "async_ptsz", "pool", "create"]


@pytest.fixture
def capped(fake_cuda, tmp_path):
    """A controller whose tenant a may hold 1 GiB and b is uncapped; a factory of tenant processes."""
    tenants = [TenantPolicy("a", 0.5, 0, GiB), TenantPolicy("b", 0.5)]
    started: list[Tenant] = []
    with running_controller(str(tmp_path / "ledger"), tenants) as c:
        def start(name: str) -> Tenant:
            tenant = Tenant(fake_cuda, tmp_path, name, c.policy.prefix)
            started.append(tenant)
            return tenant
        try:
            yield c, start
        finally:
            for tenant in started:
                if tenant.p.poll() is None:
                    tenant.p.kill()
                tenant.close()


@pytest.mark.parametrize("route", ROUTES)
def test_every_allocation_path_is_held_to_the_cap_and_a_free_gives_it_back(capped, route):
    c, start = capped
    t = start("a")
    assert t.ask("alloc", route, 256 * MiB, 4) == [0, 0, 0, 0]  # exactly the cap
    assert t.ask("alloc", route, 256 * MiB, 1) == [OOM]  # the driver's own out-of-memory code
    assert c.policy.memory[0].used == GiB and c.policy.memory[0].refused == 1
    assert t.ask("free", 2) == [0, 0]
    assert c.policy.memory[0].used == GiB // 2
    assert t.ask("alloc", route, 512 * MiB, 1) == [0]  # what was freed can be taken again
    assert t.ask("alloc", route, MiB, 1) == [OOM]
    assert t.close() == ""


def test_two_processes_of_a_tenant_share_its_cap_exactly_while_allocating_at_once(capped):
    c, start = capped
    first, second = start("a"), start("a")
    answers = {}

    def allocate(tenant: Tenant) -> None:  # 64 × 32 MiB each: together twice the cap
        answers[tenant] = tenant.ask("alloc", "symbol", 32 * MiB, 64)

    threads = [threading.Thread(target=allocate, args=(t,)) for t in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    granted = sum(rc == 0 for a in answers.values() for rc in a)
    assert granted * 32 * MiB == GiB  # not one allocation past the cap, none refused below it
    assert c.policy.memory[0].used == GiB and c.policy.memory[0].refused == 128 - granted
    wait_for(lambda: len(c.procs) == 2, what="both processes")
    held = sorted(state.view.counter("mem_bytes") for state in c.procs.values())
    assert sum(held) == GiB


def test_a_crashed_process_gives_its_memory_back(capped):
    c, start = capped
    t = start("a")
    assert t.ask("alloc", "create", 768 * MiB, 1) == [0]
    assert c.policy.memory[0].used == 768 * MiB
    os.kill(t.p.pid, signal.SIGKILL)
    t.p.wait()
    wait_for(lambda: c.policy.memory[0].used == 0, what="the dead process's memory given back")
    other = start("a")
    assert other.ask("alloc", "symbol", GiB, 1) == [0]


def test_the_card_is_shown_as_the_cap_in_cuda_and_nvml(capped):
    _, start = capped
    a, b = start("a"), start("b")
    a.ask("alloc", "symbol", 256 * MiB, 1)
    seen = a.ask("info")
    assert seen["cuda"] == {"total": GiB, "free": 768 * MiB}
    assert seen["nvml"] == {"total": GiB, "free": 768 * MiB, "used": 256 * MiB}
    assert seen["nvml_v2"] == {"total": GiB, "reserved": 0, "free": 768 * MiB, "used": 256 * MiB}
    plain = b.ask("info")  # uncapped: the card as the driver and NVML see it
    assert plain["cuda"]["total"] == CARD and plain["nvml"]["total"] == CARD
    assert plain["cuda"]["free"] == CARD  # (the fake card is each process's own)
    assert plain["nvml_v2"]["reserved"] == 2**28


def test_a_fraction_of_the_card_and_the_metrics(fake_cuda, tmp_path):
    tenants = [TenantPolicy("a", 0.5, 0, 0.25), TenantPolicy("b", 0.5)]
    with running_controller(str(tmp_path / "ledger"), tenants) as c:
        t = Tenant(fake_cuda, tmp_path, "a", c.policy.prefix)
        try:
            assert t.ask("alloc", "symbol", 10 * GiB, 3) == [0, 0, OOM]  # a quarter of 80 GiB: 20 GiB
            assert t.ask("info")["cuda"]["total"] == 20 * GiB
            registry = CollectorRegistry()
            registry.register(ShareCollector(c))
            text = generate_latest(registry).decode()
        finally:
            t.close()
    assert 'gpuscope_share_memory_cap_bytes{gpu="0",tenant="a",uuid=""} 2.147483648e+10' in text
    assert 'gpuscope_share_memory_used_bytes{gpu="0",tenant="a",uuid=""} 2.147483648e+10' in text
    assert 'gpuscope_share_memory_refused_total{gpu="0",tenant="a",uuid=""} 1.0' in text
    # uncapped: no cap series
    assert 'gpuscope_share_memory_cap_bytes{gpu="0",tenant="b",uuid=""}' not in text


def test_memory_flags():
    assert parse_memory("40GiB") == 40 * GiB and parse_memory("512MB") == 512 * 10**6
    assert parse_memory("0.4") == 0.4 and parse_memory("1") == 1.0
    assert parse_shares("online=0.3:1:40GiB,batch=0.7::0.5") == [TenantPolicy("online", 0.3, 1, 40 * GiB),
                                                                  TenantPolicy("batch", 0.7, 0, 0.5)]
    for bad, why in (("a=0.5:0:12", "at least 1MiB"), ("a=0.5:0:3XB", "unknown unit"),
                     ("a=0.5:0:lots", "neither"), ("a=0.5:0:0.6,b=0.5:0:0.6", "memory fractions add up")):
        with pytest.raises(ValueError) as info:
            parse_shares(bad)
        assert why in str(info.value), (bad, str(info.value))


def test_a_process_on_the_gpu_that_never_joined_is_reported_and_logged_once():
    on_gpu = {101: 2 * GiB, 102: GiB}
    joined = {101}
    lines: list[str] = []
    watch = UnmanagedWatch(lambda: on_gpu, lambda: joined, log=lines.append)
    watch.sample()
    assert watch.unmanaged == {}  # seen once: it may be a tenant between its context and its join
    watch.sample()
    assert watch.unmanaged == {102: GiB} and len(lines) == 1 and "pid 102" in lines[0]
    watch.sample()
    assert len(lines) == 1  # logged once
    joined.add(102)  # it joined after all
    watch.sample()
    assert watch.unmanaged == {}

    def broken() -> dict[int, int]:
        raise RuntimeError("NVML gone")

    watch.source = broken
    watch.sample()
    watch.sample()
    assert watch.errors == 2 and watch.samples == 4 and len(lines) == 2  # the failure logged once


def test_a_tenant_that_reports_less_gpu_time_than_nvml_sees_is_flagged_over_minutes():
    lines: list[str] = []
    check = ReportCheck(window_s=300, tolerance=0.15, log=lines.append)
    tenants = {11: "honest", 12: "liar"}
    charged = {"honest": 0.0, "liar": 0.0}
    for second in range(0, 301, 5):  # both keep the GPU busy 40% of the time; the liar reports 10%
        check.sample(float(second), {11: 0.4, 12: 0.4}, tenants, charged)
        if second < 250:
            assert not any(check.flagged.values())  # not yet a whole window: no verdict
        charged["honest"] += 0.4 * 5
        charged["liar"] += 0.1 * 5
    assert check.flagged == {"honest": False, "liar": True}
    assert len(lines) == 1 and "liar" in lines[0]
    assert check.nvml_busy_s["liar"] == pytest.approx(0.4 * 300)


def test_a_process_that_just_left_is_not_taken_for_an_unmanaged_one(tmp_path):
    """NVML lists a process until the driver has torn its context down, after its connection ended."""
    with running_controller(str(tmp_path / "ledger"), [TenantPolicy("a", 1.0)]) as c:
        sock, _, fds, _ = join(c.policy.prefix, "a")
        for fd in fds:
            os.close(fd)
        me = os.getpid()
        wait_for(lambda: me in c.joined_pids(), what="its adoption")
        sock.close()
        wait_for(lambda: me not in c.procs, what="its departure")
        assert me in c.joined_pids()  # still, for the unmanaged-process watch


def test_a_process_may_hold_itself_below_its_tenants_cap_never_above(fake_cuda, tmp_path):
    tenants = [TenantPolicy("a", 0.5, 0, GiB), TenantPolicy("b", 0.5)]
    with running_controller(str(tmp_path / "ledger"), tenants) as c:
        small = Tenant(fake_cuda, tmp_path, "a", c.policy.prefix, memory="256MiB")
        large = Tenant(fake_cuda, tmp_path, "a", c.policy.prefix, memory="4GiB")  # cannot raise a's 1 GiB
        uncapped = Tenant(fake_cuda, tmp_path, "b", c.policy.prefix, memory="0.25")
        try:
            assert small.ask("alloc", "symbol", 128 * MiB, 3) == [0, 0, OOM]
            assert small.ask("info")["cuda"] == {"total": 256 * MiB, "free": 0}
            assert large.ask("alloc", "symbol", 256 * MiB, 4) == [0, 0, 0, OOM]  # a's cap, less small's
            assert uncapped.ask("alloc", "symbol", 10 * GiB, 3) == [0, 0, OOM]  # a quarter of 80 GiB
            assert uncapped.ask("info")["cuda"] == {"total": 20 * GiB, "free": 0}
        finally:
            for t in (small, large, uncapped):
                t.close()
