"""The ledger against a hostile local user: what another user (nobody, through setpriv) and a tenant
can and cannot do to the controller and to other tenants. Each test is an attack that worked on the
file-based ledger: truncating a mapped file (SIGBUS), planted symlinks and squatted names, forged
slots, a second controller, files left by a failed start, tenants never taken back after a restart,
and the /metrics server held by stalled clients."""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from gpuscope.share import joins
from gpuscope.share.access import Access, Peer, parse_allow, process_cgroups
from gpuscope.share.joins import hello
from gpuscope.share.ledger import LAYOUT_VERSION, Policy, TenantPolicy
from gpuscope.util.freeport import free_port
from tests.conftest import wait_for
from tests.share.fakecuda import HERE, Joined, child_env, running_controller
from tests.share.hostile import JOIN_SCRIPT, NOBODY, as_nobody, join, other_user_python, shared_folder

TENANTS = [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)]


def controller(prefix: str, access: Access | None = None):
    return running_controller(prefix, TENANTS, access=access)


def share_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuscope.cli", "share", "--share", "a=0.5,b=0.5",
                           "--web.listen-address", f"127.0.0.1:{free_port()}", *argv],
                          capture_output=True, text=True, timeout=timeout)


def nobody_joins(python: str, prefix: str, tenant: str) -> tuple[int, int]:
    request = hello(tenant, LAYOUT_VERSION).hex()
    run = subprocess.run(as_nobody(python, "-c", JOIN_SCRIPT, prefix + ".sock", request),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    status, fds = run.stdout.split()
    return int(status), int(fds)


def test_nothing_another_user_can_write_is_left_where_the_controller_maps_or_trusts_it():
    python = other_user_python()
    with shared_folder() as folder, controller(str(folder / "ledger")) as c:
        names = sorted(os.listdir(folder))
        assert names == ["ledger.lock", "ledger.sock"]
        for name in names:
            st = os.lstat(folder / name)
            assert st.st_uid == os.geteuid()
            if stat.S_ISREG(st.st_mode):
                assert st.st_mode & 0o022 == 0  # nobody else may write or resize the lock
        for attack in (["truncate", "-s", "0", str(folder / "ledger.lock")],
                       ["rm", "-f", str(folder / "ledger.lock"), str(folder / "ledger.sock")],
                       ["mv", str(folder / "ledger.sock"), str(folder / "moved")]):
            run = subprocess.run(as_nobody(*attack), capture_output=True, text=True)
            assert run.returncode != 0, attack  # the sticky folder and the modes refuse every one
        assert sorted(os.listdir(folder)) == names
        # the controller still runs and admits its own tenants; the other user is refused
        sock, status, fds, _ = join(c.policy.prefix, "a")
        try:
            assert status == joins.OK and len(fds) == 4
            wait_for(lambda: os.getpid() in c.procs, what="the join to be adopted")
        finally:
            for fd in fds:
                os.close(fd)
            sock.close()
        assert nobody_joins(python, c.policy.prefix, "a") == (joins.NOT_ALLOWED, 0)


def test_a_tenant_can_neither_resize_its_pages_nor_write_the_policy(tmp_path):
    with controller(str(tmp_path / "ledger")) as c:
        sock, status, fds, _ = join(c.policy.prefix, "b")
        try:
            assert status == joins.OK
            policy_fd, _, page_fd, _ = fds
            for fd in fds:  # sealed (or read-only): a SIGBUS through truncation is impossible for anyone
                for size in (0, 1 << 20):
                    with pytest.raises(OSError):
                        os.ftruncate(fd, size)
                assert os.fstat(fd).st_size == 4096
            with pytest.raises(OSError):
                os.write(policy_fd, b"x")
            with pytest.raises(PermissionError):
                mmap.mmap(policy_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # what it may write: its own page (it claims another pid and tenant there: nothing changes)
            page = mmap.mmap(page_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            page[8:12] = (1).to_bytes(4, "little")  # pid 1
            page[12:16] = (0).to_bytes(4, "little")  # slot of tenant a
            wait_for(lambda: os.getpid() in c.procs, what="the join to be adopted")
            view = c.procs[os.getpid()].view
            assert (view.pid, view.slot, view.tenant) == (os.getpid(), 1, "b")
            assert 1 not in c.procs
            page.close()
        finally:
            for fd in fds:
                os.close(fd)
            sock.close()
        wait_for(lambda: os.getpid() not in c.procs, what="its departure, seen from its connection's end")


def test_a_process_of_another_user_joins_only_where_the_policy_allows_it():
    python = other_user_python()
    with shared_folder() as folder:
        with controller(str(folder / "l1")) as c:
            assert nobody_joins(python, c.policy.prefix, "a") == (joins.NOT_ALLOWED, 0)
            assert nobody_joins(python, c.policy.prefix, "nosuch") == (joins.UNKNOWN_TENANT, 0)
            assert c.policy.joins.results["not_allowed"] == 1 and c.procs == {}
        with controller(str(folder / "l2"), Access(parse_allow(f"a=uid:{NOBODY}"))) as c:
            assert nobody_joins(python, c.policy.prefix, "a") == (joins.OK, 4)
            assert nobody_joins(python, c.policy.prefix, "b") == (joins.NOT_ALLOWED, 0)  # b: its default
            assert c.policy.joins.results["joined"] == 1


def test_admission_by_uid_group_and_cgroup():
    me = Peer(os.getpid(), os.getuid(), os.getgid())
    cgroup = process_cgroups(os.getpid())[0]
    parent = cgroup.rsplit("/", 1)[0] or "/"
    allow = parse_allow(f"a=cgroup:{parent},b=gid:{os.getgid()},c=uid:{os.getuid() + 1}|cgroup:/nowhere,"
                        "d=any")
    access = Access(allow, own_uid=os.getuid() + 1)
    assert access.admits("a", me) and access.admits("b", me) and access.admits("d", me)
    assert not access.admits("c", me)
    assert not access.admits("e", me)  # not named: the controller's own user only (here: someone else)
    for bad in ("a=root", "a=uid:x", "a=cgroup:relative", "a=user:no-such-user-here", "a", "a=uid:1,a=any"):
        with pytest.raises(ValueError):
            parse_allow(bad)


def test_planted_symlinks_and_squatted_names_stop_the_start_and_touch_nothing(tmp_path):
    other_user_python()
    secret = tmp_path / "secret"  # a root-owned file the attacker wants truncated and opened up
    secret.write_text("keep me")
    secret.chmod(0o600)
    with shared_folder() as folder:
        for name, plant, why in (
                ("ledger.lock", ["ln", "-s", str(secret)], "symbolic link"),
                ("ledger.sock", ["ln", "-s", str(secret)], "not this user's socket"),
                ("ledger.lock", ["touch"], f"belongs to uid {NOBODY}"),
                ("ledger.sock", ["touch"], "not this user's socket")):
            target = folder / name
            subprocess.run(as_nobody(*plant, str(target)), check=True)
            before = sorted(os.listdir(folder))
            run = share_cli("--share.ledger", str(folder / "ledger"))
            assert run.returncode == 2 and why in run.stderr, (name, plant, run.stderr)
            assert run.stderr.count("\n") == 1
            assert sorted(os.listdir(folder)) == before  # nothing created beside the planted name
            assert secret.read_text() == "keep me" and stat.S_IMODE(secret.stat().st_mode) == 0o600
            assert os.lstat(target).st_uid == NOBODY  # nor the planted name touched
            subprocess.run(as_nobody("rm", "-f", str(target)), check=True)


def test_a_second_controller_refuses_in_one_line_and_leaves_the_first_alone(tmp_path):
    with controller(str(tmp_path / "ledger")) as c:
        inode = os.lstat(c.policy.prefix + ".sock").st_ino
        run = share_cli("--share.ledger", c.policy.prefix)
        assert run.returncode == 2 and run.stderr.count("\n") == 1
        assert f"another gpuscope share (pid {os.getpid()}) holds the ledger" in run.stderr
        assert os.lstat(c.policy.prefix + ".sock").st_ino == inode
        sock, status, fds, _ = join(c.policy.prefix, "a")
        for fd in fds:
            os.close(fd)
        sock.close()
        assert status == joins.OK


def test_a_failed_start_creates_nothing(tmp_path):
    folder = tmp_path / "ledgers"
    folder.mkdir()
    run = share_cli("--share.ledger", str(folder))  # a folder, not a prefix
    assert run.returncode == 2 and "is a folder" in run.stderr and run.stderr.count("\n") == 1
    assert os.listdir(folder) == [] and sorted(os.listdir(tmp_path)) == ["ledgers"]
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)  # writable by everyone, not sticky: anyone could swap the files
    run = share_cli("--share.ledger", str(open_folder / "ledger"))
    assert run.returncode == 2 and "not sticky" in run.stderr
    assert os.listdir(open_folder) == []
    run = share_cli("--share.ledger", str(tmp_path / "missing" / "ledger"))
    assert run.returncode == 2 and "No such file or directory" in run.stderr
    assert sorted(os.listdir(tmp_path)) == ["ledgers", "open"]


def test_connections_that_never_say_hello_do_not_keep_tenants_out(tmp_path):
    with controller(str(tmp_path / "ledger")) as c:
        idle = []
        for _ in range(joins.MAX_PENDING + 20):  # more than may wait: the oldest are closed
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(c.policy.prefix + ".sock")
            idle.append(s)
        try:
            sock, status, fds, _ = join(c.policy.prefix, "a")
            for fd in fds:
                os.close(fd)
            sock.close()
            assert status == joins.OK
            wait_for(lambda: c.policy.joins.results["timeout"] >= 20, what="the oldest idle ones closed")
        finally:
            for s in idle:
                s.close()
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bad.connect(c.policy.prefix + ".sock")
        bad.send(b"GET / HTTP/1.1\r\n\r\n")
        reply = bad.recv(1024)
        bad.close()
        assert joins.REPLY.unpack(reply)[1] == joins.BAD_HELLO
        assert c.policy.joins.results["bad_hello"] == 1


RUNNING_TENANT = """
import ctypes, json, sys, time
cuda = ctypes.CDLL('libcuda.so.1'); own = ctypes.CDLL(None); U = ctypes.c_uint
out = (ctypes.c_uint64 * 8)()
end = time.time() + 60
n = 0
while time.time() < end and not sys.stdin.closed:
    cuda.cuLaunchKernel(None, U(n), U(1), U(1), U(5), U(1), U(1), U(0), ctypes.c_void_p(1), None, None)
    n += 1
    time.sleep(0.001)
"""


def test_a_restarted_controller_takes_running_tenants_back(fake_cuda, tmp_path):
    prefix = str(tmp_path / "ledger")
    env = child_env(fake_cuda, os.devnull, tenant="a", ledger=prefix)
    first = Policy(prefix, TENANTS)
    joined = Joined(first)
    tenant = subprocess.Popen([sys.executable, "-c", RUNNING_TENANT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    beating = threading.Event()
    beating.set()
    second = None
    pages = threading.Lock()  # a policy is closed (unmapped) only while the heartbeat is not writing it

    def heartbeat() -> None:
        while beating.is_set():
            with pages:
                for policy in (first, second):
                    if policy is not None:
                        policy.heartbeat()
            time.sleep(0.05)

    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        assert joined.one().pid == tenant.pid
        joined.close()
        with pages:
            first.close()  # the controller stops: the tenant's connection ends, it fails open
            first = None
        second = Policy(prefix, TENANTS)
        rejoined = Joined(second)
        view = rejoined.one(timeout=15)  # it looks for a controller every 0.5 s
        assert view.pid == tenant.pid and view.slot == 0
        second.set_gate(0b10)  # only b may launch: the returned tenant is held again
        wait_for(lambda: view.waiting == 1, what="the returned tenant held at the gate")
        launches = view.counter("launches")
        time.sleep(0.1)  # held: no launch goes through while the gate stays closed to it
        assert view.counter("launches") == launches and view.counter("failed_open") == 0
        second.set_gate(0b11)
        wait_for(lambda: view.counter("launches") > launches, what="launches once the gate opens again")
        rejoined.close()
    finally:
        beating.clear()
        beat.join()
        tenant.kill()
        _, err = tenant.communicate(timeout=30)
        for policy in (first, second):
            if policy is not None:
                policy.close()
    assert "controller is gone" in err and "joined the share controller again" in err


def test_a_fake_controller_cannot_hand_a_tenant_pages_it_could_truncate(fake_cuda, tmp_path):
    """A tenant maps only sealed pages: a controller (or whoever listens at the name as root or as the
    tenant's user) that hands over plain memory it could then truncate is refused."""
    prefix = str(tmp_path / "ledger")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(prefix + ".sock")
    listener.listen(4)

    def fake_controller() -> None:
        conn, _ = listener.accept()
        conn.recv(1024)
        fds = [os.memfd_create("plain") for _ in range(4)]
        for fd in fds:
            os.ftruncate(fd, 4096)
        socket.send_fds(conn, [joins.REPLY.pack(joins.REPLY_MAGIC, joins.OK, 0, os.getpid(), b"")], fds)
        for fd in fds:
            os.ftruncate(fd, 0)  # what would kill the tenant with SIGBUS, had it mapped them
            os.close(fd)
        conn.recv(1024)  # until the tenant hangs up
        conn.close()

    server = threading.Thread(target=fake_controller)
    server.start()
    try:
        run = subprocess.run([sys.executable, str(HERE / "launcher.py"), "2"],
                             env=child_env(fake_cuda, tmp_path / "log", tenant="a", ledger=prefix),
                             capture_output=True, text=True, timeout=60)
    finally:
        server.join(30)
        listener.close()
    assert run.returncode == 0 and run.returncode != -signal.SIGBUS, run.stderr
    assert "not sealed" in run.stderr
    assert json.loads(run.stdout)["stats"]["launches"] == 14  # it ran, unthrottled


def test_the_metrics_server_bounds_stalled_clients_and_answers_in_json(tmp_path):
    import urllib.error
    import urllib.request

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuscope.cli", "share", "--share", "a=0.5,b=0.5",
                             "--share.ledger", str(tmp_path / "ledger"), "--web.listen-address",
                             f"127.0.0.1:{port}", "--web.max-connections", "8", "--web.read-timeout", "2s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    stalled: list[socket.socket] = []

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def threads() -> int:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))

    try:
        wait_for(lambda: proc.poll() is not None or get("/metrics")[0] == 200, what="/metrics")
        base = threads()
        for _ in range(100):  # clients that connect and send nothing
            s = socket.create_connection(("127.0.0.1", port))
            stalled.append(s)
        status, text = get("/metrics")  # still answered: the longest-waiting stalled one is evicted
        assert status == 200 and "gpuscope_share_target_ratio" in text
        assert threads() <= base + 8 + 2
        assert 'gpuscope_share_http_connections_closed_total{reason="evicted"}' in text
        status, body = get("/nope")
        assert status == 404 and "no such path" in json.loads(body)["error"]
        raw = socket.create_connection(("127.0.0.1", port))
        raw.sendall(b"NONSENSE\r\n\r\n")
        answer = raw.recv(4096).decode()
        raw.close()
        assert answer.startswith("HTTP/1.") and " 400 " in answer.split("\r\n", 1)[0]
        assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]
    finally:
        for s in stalled:
            s.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
