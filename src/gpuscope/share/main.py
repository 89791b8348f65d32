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

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuscope.contract import catalogue as cat
from gpuscope.share.access import Access
from gpuscope.share.controller import Controller
from gpuscope.share.crosscheck import SAMPLE_EVERY_S as CROSSCHECK_EVERY_S
from gpuscope.share.crosscheck import ReportCheck, nvml_mean_utilization
from gpuscope.share.files import LedgerError
from gpuscope.share.metrics import ShareCollector
from gpuscope.share.nvml_source import nvml_utilization
from gpuscope.share.policy import PolicyFile
from gpuscope.share.preload import library_path
from gpuscope.share.settings import PROBE_S, Accounting, ShareSettings
from gpuscope.share.unmanaged import UnmanagedWatch, nvml_processes
from gpuscope.util.flags import parse_listen_address
from gpuscope.util.metrics_http import MetricsServer, page
from gpuscope.util.settings import SettingsParser, parser_for

#: Probes more often than this would pause the slice holder for a fifth of its time.
MIN_PROBE_EVERY_S = 5 * PROBE_S


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
        controller = Controller(args.ledger, tenants, args, utilization=utilization, access=Access(allow),
                                policy_file=policy_file)
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
