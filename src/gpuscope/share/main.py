"""gpuscope share: hold separate processes on one GPU to shares of its time, measured by CUDA events.

Start the controller, then start each process with the preload library and its tenant's name:

    gpuscope share --share online=0.3:1,batch=0.7
    LD_PRELOAD=$(python -m gpuscope.share.preload) GPUSCOPE_SHARE_TENANT=online python serve.py

docs/share.md explains the mechanism, its limits and its security model.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuscope.contract import catalogue as cat
from gpuscope.contract.choices import Choice
from gpuscope.contract.parts import LOCAL_HOST, SHARE_PORT
from gpuscope.share.access import Access, Rule, parse_allow
from gpuscope.share.controller import DEFAULT_SLICE_S, PROBE_EVERY_S, PROBE_S, Controller
from gpuscope.share.crosscheck import SAMPLE_EVERY_S as CROSSCHECK_EVERY_S
from gpuscope.share.crosscheck import ReportCheck, nvml_mean_utilization
from gpuscope.share.files import LedgerError
from gpuscope.share.ledger import TenantPolicy
from gpuscope.share.metrics import ShareCollector
from gpuscope.share.nvml_source import nvml_utilization
from gpuscope.share.policy import PolicyFile, parse_shares
from gpuscope.share.preload import DEFAULT_LEDGER, library_path
from gpuscope.share.unmanaged import UnmanagedWatch, nvml_processes
from gpuscope.util.bounded_http import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT
from gpuscope.util.flags import listen_address, parse_duration, parse_listen_address
from gpuscope.util.metrics_http import MetricsServer, page
from gpuscope.util.settings import SettingsParser, parser_for, setting

#: Probes more often than this would pause the slice holder for a fifth of its time.
MIN_PROBE_EVERY_S = 5 * PROBE_S


class Accounting(Choice):
    """``--share.accounting``: what a tenant's GPU time is charged from."""

    EVENTS = "events"
    NVML = "nvml"


class Handover(Choice):
    """``--share.handover``: how the GPU passes from one slice holder to the next."""

    OVERLAP = "overlap"
    DRAIN = "drain"


class Turns(Choice):
    """``--share.turns``: where hand-overs between slice holders are decided."""

    C = "c"
    PYTHON = "python"


@dataclass(frozen=True)
class ShareSettings:
    """The flags of ``gpuscope share``."""

    shares: list[TenantPolicy] | None = setting(
        "--share", None, "tenants, their shares, priorities and memory caps: "
        "NAME=FRACTION[:PRIORITY[:MEMORY]],... (higher priority first; MEMORY a fraction of the card such as "
        "0.4, or a size such as 40GiB)",
        parse=parse_shares)
    accounting: Accounting = setting(
        "--share.accounting", Accounting.EVENTS, "events: slices charged by the tenants' CUDA events; nvml: "
        "token buckets fed by NVML utilization every 100 ms (what the peer projects do)")
    policy_file: str = setting(
        "--share.policy-file", "", "a YAML file of the tenants (shares, priorities, memory caps, admission "
        "rules) instead of --share and --share.allow; a change is applied within half a second (or at "
        "SIGHUP), after validation, without restarting anything")
    ledger: str = setting("--share.ledger", DEFAULT_LEDGER, "path prefix of the shared-memory ledger "
                          "(tenants set GPUSCOPE_SHARE_LEDGER to it)")
    slice: float = setting("--share.slice", DEFAULT_SLICE_S, "length of one tenant's turn while shares bind",
                           parse=parse_duration)
    handover: Handover = setting(
        "--share.handover", Handover.DRAIN, "drain: the next holder starts once the previous one's queued "
        "work is done (the holder stops at its slice's end by itself and drains; exact shares); overlap: the "
        "next holder starts at once, beside that work, and the overlap is split between them (the two "
        "contexts' time-slicing then costs the smaller share more)")
    turns: Turns = setting(
        "--share.turns", Turns.C, "where hand-overs are decided: c (a loop in C that wakes "
        "Python only every 250 ms; python where it was not built) or python (a wake-up of the Python loop "
        "per hand-over)")
    drain_timeout: float = setting("--share.drain-timeout", 0.2, "longest wait for a holder's queued work "
                                   "before a drain hand-over or a probe", parse=parse_duration)
    probe_every: float = setting(
        "--share.probe-every", PROBE_EVERY_S, "how often tenants running beside the slice holder are probed "
        f"(the holder paused for {PROBE_S * 1e3:g} ms while they time each launch) for the busy fraction "
        "they are charged: longer costs less CPU and holder time, shorter follows a changing workload sooner",
        parse=parse_duration)
    window: float = setting("--share.window", 0.002, "GPU time one accounting window aims at (two CUDA "
                            "events per window)", parse=parse_duration)
    queued_windows: int = setting("--share.queued-windows", 2, "finished-but-unresolved windows a slice "
                                  "holder may have queued: bounds the work a hand-over overlaps or waits for")
    gpu: int = setting("--share.gpu", 0, "NVML index of the GPU (nvml accounting, and the watch for "
                       "processes that never joined)")
    watch_interval: float = setting(
        "--share.watch-interval", 0.25, "how often NVML's list of the GPU's processes is compared with the "
        "ones that joined (a process seen twice without joining is reported)", parse=parse_duration)
    allow: dict[str, tuple[Rule, ...]] | None = setting(
        "--share.allow", None, "which processes may join as which tenant: NAME=RULE[|RULE...],... with rules "
        "uid:N, user:NAME, gid:N, group:NAME, cgroup:PATH, any (a tenant not named: the controller's own "
        "user only)", parse=parse_allow)
    listen: str = setting("--web.listen-address", f"{LOCAL_HOST}:{SHARE_PORT}", "HOST:PORT for /metrics",
                          parse=listen_address, metavar="HOST:PORT")
    max_connections: int = setting(
        "--web.max-connections", DEFAULT_MAX_CONNECTIONS, "most HTTP connections at once: at the limit "
        "the one waiting longest for a request is closed, or with all busy the new one gets a 503")
    read_timeout: float = setting(
        "--web.read-timeout", DEFAULT_READ_TIMEOUT, "a connection must deliver each whole request "
        "within this (idle keep-alive time included), else it is closed", parse=parse_duration)


def _parser() -> SettingsParser[ShareSettings]:
    return parser_for(ShareSettings, prog="gpuscope share", description=__doc__.splitlines()[0])


def exposition(registry: CollectorRegistry) -> Callable[[str], tuple[bytes, str]]:
    """The registry rendered in the format an Accept header asks for."""
    def render(accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(registry), content_type
    return render


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_settings(argv)
    policy_file = None
    tenants, allow = args.shares, args.allow
    if args.policy_file:
        if args.shares is not None or args.allow is not None:
            parser.error("give the tenants either in --share (and --share.allow) or in --share.policy-file")
        policy_file = PolicyFile(args.policy_file)
        try:
            spec = policy_file.read()
        except ValueError as exc:
            parser.error(f"--share.policy-file {args.policy_file}: {exc}")
        tenants, allow = spec.tenants, spec.allow
    if tenants is None:
        parser.error("--share is required: NAME=FRACTION[:PRIORITY[:MEMORY]],... (or --share.policy-file)")
    if not 1 <= args.queued_windows <= 255:
        parser.error(f"--share.queued-windows must be between 1 and 255, not {args.queued_windows}")
    if args.probe_every < MIN_PROBE_EVERY_S:
        parser.error(f"--share.probe-every must be at least {MIN_PROBE_EVERY_S:g}s (a probe pauses the slice "
                     f"holder for {PROBE_S:g}s), not {args.probe_every:g}s")
    if not 1 <= args.max_connections <= 100_000:
        parser.error(f"--web.max-connections must be between 1 and 100000, not {args.max_connections}")
    unknown = sorted(set(allow or {}) - {t.name for t in tenants})
    if unknown:
        parser.error(f"--share.allow names tenants --share does not: {', '.join(unknown)}")
    host, port = parse_listen_address(args.listen)
    if library_path() is None:
        parser.error("the preload library is not built: reinstall gpuscope where a C compiler is present")

    utilization = None
    if args.accounting == Accounting.NVML:
        try:
            utilization = nvml_utilization(args.gpu)
        except Exception as exc:  # NVML missing or no such GPU: one line, not a traceback
            parser.error(f"--share.accounting nvml needs NVML and GPU {args.gpu}: {exc}")
    try:
        controller = Controller(args.ledger, tenants, mode=args.accounting, slice_s=args.slice,
                                drain_timeout_s=args.drain_timeout, window_us=int(args.window * 1e6),
                                probe_every_s=args.probe_every,
                                handover=str(args.handover), inflight_slice=args.queued_windows,
                                utilization=utilization, keeper=args.turns == Turns.C,
                                access=Access(allow), policy_file=policy_file)
    except LedgerError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"cannot create the ledger at {args.ledger}: {exc.strerror or exc}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before /metrics answers: a stop then is a clean one
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: setattr(controller, "reload_now", True))  # reread the file now
    watch = None
    check = ReportCheck(log=controller.log)
    try:
        sampled = nvml_mean_utilization(args.gpu)
        last_check = [0.0]

        def cross_check() -> None:
            now = time.monotonic()
            if now - last_check[0] >= CROSSCHECK_EVERY_S:
                last_check[0] = now
                check.sample(now, sampled(), controller.tenants_by_pid(), controller.charged_seconds())

        watch = UnmanagedWatch(nvml_processes(args.gpu), controller.joined_pids,
                               interval_s=args.watch_interval, log=controller.log, also=cross_check)
    except Exception as exc:  # no NVML (a CPU host, a container without the driver's library): say so once
        controller.log(f"gpuscope share: NVML cannot list GPU {args.gpu}'s processes ({exc}): processes that "
                       "never joined go unseen")
    registry = CollectorRegistry()
    registry.register(ShareCollector(controller, watch, check if watch is not None else None))
    if watch is not None:
        watch.start()
    try:
        server = MetricsServer((host, port), exposition(registry), lambda: {"status": "ok"},
                               page=page("gpuscope share", "GPU-time shares and memory caps of processes."),
                               closed_metric=cat.SHARE_HTTP_CONNECTIONS_CLOSED,
                               log=logging.getLogger("gpuscope.share"),
                               max_connections=args.max_connections, read_timeout=args.read_timeout)
    except OSError as exc:
        controller.close()
        parser.error(f"cannot listen on {args.listen}: {exc.strerror or exc}")
    server.serve_in_thread()
    shares = ", ".join(f"{t.name}={t.share:g}:{t.priority}" + (f":{t.memory:g}" if t.memory else "")
                       for t in tenants)
    sys.stderr.write(f"gpuscope share: {shares}; ledger {args.ledger}; accounting {args.accounting}; "
                     f"/metrics on {server.url}/metrics\n")
    try:
        controller.run(stop)
    finally:
        if watch is not None:
            watch.stop()
        server.shutdown()
        server.server_close()
        controller.close()
    return 0
