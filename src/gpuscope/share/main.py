"""gpuscope share: hold separate processes on a node's GPUs to shares of their time, measured by CUDA events.

Start the controller, then start each process with the preload library and its tenant's name:

    gpuscope share --share online=0.3:1,batch=0.7
    LD_PRELOAD=$(python -m gpuscope.share.preload) GPUSCOPE_SHARE_TENANT=online python serve.py

The controller holds every GPU of the node (--share.gpus), each with its own ledger and shares (a
policy file may give a GPU shares of its own); a process is held on each GPU it uses by that GPU's
shares. A job whose ranks run collectives across GPUs is a gang (--share.gang): its turns are
granted on all its GPUs at once.

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
from gpuscope.share.crosscheck import SAMPLE_EVERY_S as CROSSCHECK_EVERY_S
from gpuscope.share.crosscheck import ReportCheck, nvml_mean_utilization
from gpuscope.share.files import LedgerError
from gpuscope.share.gpus import NO_INDEX, Gpu, select
from gpuscope.share.metrics import GpuWatch, ShareCollector
from gpuscope.share.node import Node
from gpuscope.share.nvml_source import nvml_utilization
from gpuscope.share.policy import PolicyFile, PolicySpec, with_gangs
from gpuscope.share.preload import library_path
from gpuscope.share.settings import PROBE_LEAD_S, PROBE_S, Accounting, ShareSettings
from gpuscope.share.unmanaged import UnmanagedWatch, nvml_processes
from gpuscope.util.flags import parse_listen_address
from gpuscope.util.metrics_http import MetricsServer, page
from gpuscope.util.settings import SettingsParser, parser_for

#: Probes more often than this would pause the slice holder for a fifth of its time.
MIN_PROBE_EVERY_S = 5 * (PROBE_LEAD_S + PROBE_S)


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
        if args.shares is not None or args.allow is not None or args.gangs:
            parser.error("give the tenants either in --share (and --share.allow, --share.gang) or in "
                         "--share.policy-file")
        policy_file = PolicyFile(args.policy_file)
        try:
            spec = policy_file.read()
        except ValueError as exc:
            parser.error(f"--share.policy-file {args.policy_file}: {exc}")
        tenants, allow = spec.tenants, spec.allow
    if tenants is None:
        parser.error("--share is required: NAME=FRACTION[:PRIORITY[:MEMORY]],... (or --share.policy-file)")
    unknown = sorted(set(args.gangs) - {t.name for t in tenants})
    if unknown:
        parser.error(f"--share.gang names tenants --share does not: {', '.join(unknown)}")
    if not args.policy_file:
        spec = PolicySpec(with_gangs(tenants, set(args.gangs)), allow or {})
    if not 1 <= args.queued_windows <= 255:
        parser.error(f"--share.queued-windows must be between 1 and 255, not {args.queued_windows}")
    if args.probe_every < MIN_PROBE_EVERY_S:
        parser.error(f"--share.probe-every must be at least {MIN_PROBE_EVERY_S:g}s (a probe pauses the slice "
                     f"holder for {PROBE_LEAD_S + PROBE_S:g}s), not {args.probe_every:g}s")
    if not 1 <= args.probe_backoff <= 64:
        parser.error(f"--share.probe-backoff must be between 1 and 64, not {args.probe_backoff}")
    if not 1 <= args.max_connections <= 100_000:
        parser.error(f"--web.max-connections must be between 1 and 100000, not {args.max_connections}")
    unknown = sorted(set(allow or {}) - {t.name for t in tenants})
    if unknown:
        parser.error(f"--share.allow names tenants --share does not: {', '.join(unknown)}")
    host, port = parse_listen_address(args.listen)
    if library_path() is None:
        parser.error("the preload library is not built: reinstall gpuscope where a C compiler is present")

    log = lambda line: sys.stderr.write(line + "\n")  # noqa: E731
    notes: list[str] = []  # said once the controller has started: a refused start says one line
    try:
        gpus = select(args.gpus, log=notes.append)
    except Exception as exc:  # an index NVML does not list, or NVML failing after init
        parser.error(str(exc))

    def utilization(gpu: Gpu):
        if args.accounting != Accounting.NVML:
            return None
        if gpu.index == NO_INDEX:
            parser.error(f"--share.accounting nvml needs NVML's per-process utilization, which {gpu.uuid} "
                         "(a MIG instance) does not have")
        try:
            return nvml_utilization(gpu.index)
        except Exception as exc:  # NVML missing or no such GPU: one line, not a traceback
            parser.error(f"--share.accounting nvml needs NVML and GPU {gpu.index}: {exc}")

    try:
        node = Node(args.ledger, gpus, spec, args, utilization=utilization, policy_file=policy_file, log=log)
    except LedgerError as exc:
        parser.error(str(exc))
    except ValueError as exc:
        parser.error(f"--share.policy-file {args.policy_file}: {exc}" if args.policy_file else str(exc))
    except OSError as exc:
        parser.error(f"cannot create the ledger at {args.ledger}: {exc.strerror or exc}")
    for note in notes:
        log(note)
    stop = threading.Event()
    def stop_now(*_) -> None:
        stop.set()
        node.nudge()

    for sig in (signal.SIGTERM, signal.SIGINT):  # before /metrics answers: a stop then is a clean one
        signal.signal(sig, stop_now)
    signal.signal(signal.SIGHUP, lambda *_: node.request_reload())  # reread the file now
    watches = [_watch(c, args.watch_interval, log) for c in node.controllers]
    registry = CollectorRegistry()
    registry.register(ShareCollector(node, watches))
    for w in watches:
        if w.watch is not None:
            w.watch.start()
    try:
        server = MetricsServer((host, port), exposition(registry), lambda: {"status": "ok"},
                               page=page("gpuscope share", "GPU-time shares and memory caps of processes."),
                               closed_metric=cat.SHARE_HTTP_CONNECTIONS_CLOSED,
                               log=logging.getLogger("gpuscope.share"),
                               max_connections=args.max_connections, read_timeout=args.read_timeout)
    except OSError as exc:
        node.close()
        parser.error(f"cannot listen on {args.listen}: {exc.strerror or exc}")
    server.serve_in_thread()
    shares = ", ".join(f"{t.name}={t.share:g}:{t.priority}" + (f":{t.memory:g}" if t.memory else "")
                       + (":gang" if t.gang else "") for t in spec.tenants)
    held = ", ".join(g.name for g in gpus) if gpus[0].uuid else "the one each process uses"
    own = f" ({len(spec.gpus)} with shares of their own)" if spec.gpus else ""
    sys.stderr.write(f"gpuscope share: {shares}; GPUs {held}{own}; ledger {args.ledger}; accounting "
                     f"{args.accounting}; /metrics on {server.url}/metrics\n")
    try:
        node.run(stop)
    finally:
        for w in watches:
            if w.watch is not None:
                w.watch.stop()
        server.shutdown()
        server.server_close()
        node.close()
    return 0


def _watch(controller, interval_s: float, log: Callable[[str], None]) -> GpuWatch:
    """NVML's view of one GPU: its processes that never joined, and the cross-check of what its
    tenants report (none where NVML cannot list the GPU's processes)."""
    index = controller.gpu.index
    if index == NO_INDEX:
        log(f"gpuscope share: NVML does not list {controller.gpu.uuid}'s processes (a MIG instance): "
            "processes that never joined go unseen")
        return GpuWatch(None, None)
    check = ReportCheck(log=log)
    try:
        sampled = nvml_mean_utilization(index)
        last_check = [0.0]

        def cross_check() -> None:
            now = time.monotonic()
            if now - last_check[0] >= CROSSCHECK_EVERY_S:
                last_check[0] = now
                check.sample(now, sampled(), controller.tenants_by_pid(), controller.charged_seconds())

        watch = UnmanagedWatch(nvml_processes(index), controller.joined_pids,
                               interval_s=interval_s, log=log, also=cross_check)
    except Exception as exc:  # no NVML (a CPU host, a container without the driver's library): say so once
        log(f"gpuscope share: NVML cannot list GPU {index}'s processes ({exc}): processes that never joined "
            "go unseen")
        return GpuWatch(None, None)
    return GpuWatch(watch, check)
