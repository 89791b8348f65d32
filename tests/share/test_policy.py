"""A live policy: shares, caps and admission rules from a file, changed while tenants run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuscope.share import joins
from gpuscope.share.ledger import P_TENANTS, T_MEM_CAP, TENANT_SIZE, TenantPolicy
from gpuscope.share.metrics import ShareCollector
from gpuscope.share.policy import PolicyFile, parse_policy
from gpuscope.share.scheduler import SliceScheduler
from gpuscope.util.freeport import free_port
from tests.conftest import wait_for
from tests.share.fakecuda import Tenant, running_controller
from tests.share.hostile import join

GiB = 2**30
FIRST = """
tenants:
  online: {share: 0.7, priority: 1, memory: 1GiB}
  batch: {share: 0.3}
"""


def write(path, text: str) -> None:
    """Replace the file as a ConfigMap update does: a new file renamed over the old name."""
    tmp = f"{path}.new"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def test_a_policy_file_says_what_the_flags_say():
    extra = "  extra: {share: 0.1, allow: [uid:1001, 'cgroup:/kubepods.slice']}\n"
    spec = parse_policy(FIRST.replace("0.3", "0.2") + extra)
    assert spec.tenants[:2] == [TenantPolicy("online", 0.7, 1, GiB), TenantPolicy("batch", 0.2)]
    assert [str(r) for r in spec.allow["extra"]] == ["uid:1001", "cgroup:/kubepods.slice"]
    for bad, why in (("tenants: [a, b]", "expected a mapping"), ("tenants: {a: {share: 2}}", "(0, 1]"),
                     ("tenants: {a: {share: 0.6}, b: {share: 0.6}}", "add up to 1.2"),
                     ("tenants: {a: {share: 0.5, weight: 3}}", "unknown keys ['weight']"),
                     ("tenants: {a: {share: 0.5, allow: [root]}}", "uid:N"),
                     ("tenants: {a: {share: 0.5, memory: 12}}", "at least 1MiB"),
                     ("tenants: {a: {share: x}}", "must be a number"), ("{{", "not YAML"),
                     ("tenants: {a: {share: 0.5}}\nshares: 1", "unknown keys")):
        with pytest.raises(ValueError) as info:
            parse_policy(bad)
        assert why in str(info.value), (bad, str(info.value))


def entry(c, slot: int) -> tuple[int, int, int]:
    """A tenant's share (ppm), priority and memory cap as the policy page holds them."""
    base = P_TENANTS + slot * TENANT_SIZE
    return c.policy.map.u32(base + 40), c.policy.map.u32(base + 44), c.policy.map.u64(base + T_MEM_CAP)


def test_a_changed_file_is_applied_live_a_bad_one_refused_and_a_removed_tenant_keeps_running(
        fake_cuda, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(FIRST)
    policy_file = PolicyFile(str(path))
    spec = policy_file.read()
    with running_controller(str(tmp_path / "ledger"), spec.tenants, policy_file=policy_file) as c:
        batch = Tenant(fake_cuda, tmp_path, "batch", c.policy.prefix)
        try:
            assert batch.ask("alloc", "symbol", 2**20, 1) == [0]  # joined (at its first allocation)
            write(path, "tenants:\n  online: {share: 0.5, priority: 1, memory: 2GiB}\n"
                        "  batch: {share: 0.5}\n")
            wait_for(lambda: c.stats.policy_reloads["applied"] == 1, what="the change to be applied")
            assert entry(c, 0) == (500_000, 1, 2 * GiB) and entry(c, 1) == (500_000, 0, 0)
            assert c.scheduler.tenants[0].share == 0.5

            write(path, "tenants:\n  online: {share: 0.9}\n  batch: {share: 0.5}\n")  # sums to 1.4
            wait_for(lambda: c.stats.policy_reloads["refused"] == 1, what="the bad file to be refused")
            assert entry(c, 0) == (500_000, 1, 2 * GiB)  # the policy in force stays

            # batch removed while its process runs, a new tenant added
            write(path, "tenants:\n  online: {share: 0.6}\n  spot: {share: 0.4, memory: 0.1}\n")
            wait_for(lambda: c.stats.policy_reloads["applied"] == 2, what="the second change")
            assert [t.name for t in c.tenants] == ["online", "batch", "spot"]
            assert entry(c, 1)[0] == 0 and entry(c, 2)[0] == 400_000
            assert batch.ask("alloc", "symbol", 2**20, 1) == [0]  # it keeps running, on what others leave
            assert batch.p.pid in c.procs
            sock, status, fds, _ = join(c.policy.prefix, "batch")  # but no new process may join as it
            sock.close()
            assert status == joins.UNKNOWN_TENANT and fds == []
            sock, status, fds, _ = join(c.policy.prefix, "spot")
            for fd in fds:
                os.close(fd)
            sock.close()
            assert status == joins.OK
            registry = CollectorRegistry()
            registry.register(ShareCollector(c))
            text = generate_latest(registry).decode()
        finally:
            batch.close()
    assert 'gpuscope_share_target_ratio{gpu="0",tenant="spot",uuid=""} 0.4' in text
    assert 'gpuscope_share_target_ratio{gpu="0",tenant="batch",uuid=""} 0.0' in text
    assert 'gpuscope_share_policy_reloads_total{result="refused"} 1.0' in text


def test_a_removed_tenant_sets_no_slice_length():
    s = SliceScheduler([TenantPolicy("a", 0.6), TenantPolicy("gone", 0.0), TenantPolicy("b", 0.2)])
    assert s.quantum(0, {0, 1, 2}, 0.03) == pytest.approx(0.09)  # 3x the smallest share still held
    assert s.quantum(1, {0, 1, 2}, 0.03) == pytest.approx(0.03)


def test_the_command_takes_a_policy_file_and_refuses_a_bad_one_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: {a: {share: 3}}\n")
    for argv, why in ((["--share.policy-file", str(bad)], "(0, 1]"),
                      (["--share.policy-file", str(tmp_path / "none.yaml")], "cannot read"),
                      (["--share.policy-file", str(bad), "--share", "a=0.5"], "either in --share")):
        run = subprocess.run([sys.executable, "-m", "gpuscope.cli", "share", "--share.ledger",
                              str(tmp_path / "ledger"), "--web.listen-address", f"127.0.0.1:{free_port()}",
                              *argv], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and why in run.stderr, run.stderr


def test_a_policy_file_another_user_could_write_is_refused(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(FIRST)
    path.chmod(0o646)  # writable by everyone: anyone could give themselves the GPU
    with pytest.raises(ValueError, match="could be written by another user"):
        PolicyFile(str(path)).read()
    path.chmod(0o644)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # the file is fine, its folder lets anyone replace it
    (shared / "policy.yaml").write_text(FIRST)
    with pytest.raises(ValueError, match="lets another user replace"):
        PolicyFile(str(shared / "policy.yaml")).read()
    link = tmp_path / "link.yaml"  # a ConfigMap's name is a symlink into its data folder: followed, checked
    link.symlink_to(shared / "policy.yaml")
    with pytest.raises(ValueError, match="lets another user replace"):
        PolicyFile(str(link)).read()
    assert PolicyFile(str(path)).read().tenants[0].name == "online"
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)  # owned by another user
        with pytest.raises(ValueError, match="owner uid 65534"):
            PolicyFile(str(path)).read()
