"""``gpuscope stack``: the compose stack from local binaries (gpuscope.ops.stack), or with
``--stack.hosts N`` a fleet of N hosts on this machine (gpuscope.ops.fleet). It waits until every
part is healthy, prints where each listens, and stops them all on Ctrl-C (SIGINT) or SIGTERM, also
when started with SIGINT ignored (``gpuscope stack &`` in a script).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from gpuscope.contract.parts import LOCAL_HOST
from gpuscope.ops.fleet import MAX_HOSTS, Fleet, FleetOptions
from gpuscope.ops.stack import COMPONENTS, PROFILES, Stack, StackError, StackOptions, find_root
from gpuscope.util.flags import FlagParser, checked


def _parse_ports(items: Iterable[str]) -> dict[str, int]:
    ports = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in COMPONENTS or not value.isdigit() or not 0 < int(value) < 65536:
            raise ValueError(f"--stack.port {item!r} is not PART=PORT "
                             f"with PART one of {', '.join(COMPONENTS)}")
        ports[name] = int(value)
    return ports


def _parser() -> FlagParser:
    parser = FlagParser(
        prog="gpuscope stack",
        description="Start server, exporter, receiver, Prometheus, Alertmanager and node_exporter from "
                    "local binaries with the compose stack's configuration. Flags after `--` go to "
                    "`gpuscope serve`.")
    parser.add_flag("--stack.profile", dest="profile", choices=PROFILES, default="production",
                    help="alert rule profile: production, or test (compressed windows, 1s evaluation)")
    parser.add_flag("--stack.run-dir", dest="run_dir", default=".stack",
                    help="directory for rendered configs, data and logs")
    parser.add_flag("--stack.keep-data", dest="keep_data", action=argparse.BooleanOptionalAction,
                    default=False, help="keep the stored series and alerts of the last run in the run dir "
                                        "(default: start with none, so no old series shows up)")
    parser.add_flag("--stack.host", dest="host", default=LOCAL_HOST, help="address every part listens on")
    parser.add_flag("--stack.root", dest="root", type=Path, default=None,
                    help="the gpuscope checkout whose configuration files to run with (default: the one at "
                         "or above the current directory)")
    parser.add_flag("--stack.free-ports", dest="free_ports", action=argparse.BooleanOptionalAction,
                    default=False, help="pick a free port for every part instead of the defaults")
    parser.add_argument("--stack.port", dest="port", action="append", default=[], metavar="PART=PORT",
                        help="listen port of one part (repeatable), e.g. server=18000")
    parser.add_flag("--stack.source", dest="source", choices=("gpuscope-server", "vllm"),
                    default="gpuscope-server",
                    help="the server's metrics: gpuscope's, or vllm (the server exposes vLLM's names, is "
                         "scraped as job vllm, and the rules read them through the vLLM source)")
    parser.add_flag("--stack.server", dest="server", action=argparse.BooleanOptionalAction, default=True,
                    help="start the reference server (--no-stack.server: run your own on its port)")
    parser.add_flag("--stack.hosts", dest="hosts", type=checked(_host_count), default=0, metavar="N",
                    help="run the fleet profile instead (docs/fleet.md): N hosts of server, exporter, "
                         "node_exporter and vmagent remote-writing to one VictoriaMetrics, with vmalert, "
                         "Alertmanager and the receiver")
    return parser


def _host_count(text: str) -> int:
    if not text.strip().isdigit() or int(text) > MAX_HOSTS:
        raise ValueError(f"{text!r} is not a number of hosts from 0 (no fleet) to {MAX_HOSTS}")
    return int(text)


def _fleet(args: argparse.Namespace, server_args: list[str]) -> Fleet:
    """``--stack.hosts N``: the same command runs gpuscope.ops.fleet, with the same ports, run
    directory, profile and server flags."""
    return Fleet(FleetOptions(hosts=args.hosts, profile=args.profile, address=args.host,
                              ports="free" if args.free_ports else "default", run_dir=Path(args.run_dir),
                              server_args=server_args, root=find_root(args.root)))


#: Data the parts store under the run directory (Stack's and Fleet's), at its top or one level down
#: (a fleet's central/ and host directories): what a run leaves behind for the next one.
DATA_DIRS = ("prometheus-data", "alertmanager-data", "victoria-metrics-data", "vmagent-queue")

#: Signals that stop the command; both also when its parent ignored them (``cmd &`` in a script
#: starts it with SIGINT ignored, and Python then leaves SIGINT ignored).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def clear_data(run_dir: Path) -> list[Path]:
    """Remove the stored data of an earlier run from ``run_dir`` (DATA_DIRS only: configs and logs are
    rewritten anyway, and nothing else in the directory is touched); return what was removed."""
    removed = []
    for pattern in (*DATA_DIRS, *(f"*/{name}" for name in DATA_DIRS)):
        for path in sorted(run_dir.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                try:
                    shutil.rmtree(path)
                except OSError as exc:
                    raise StackError(f"cannot remove {path} of the last run: {exc.strerror or exc} "
                                     "(--stack.keep-data keeps it)") from None
                removed.append(path)
    return removed


def _stop(signum: int, frame: object) -> None:
    # Once: a second signal while the parts stop must not cut their orderly stop short (each part
    # still gets SIGKILL after its grace).
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    server_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        ports: str | dict[str, int] = "free" if args.free_ports else _parse_ports(args.port) or "default"
    except ValueError as exc:
        parser.error(str(exc))
    if args.hosts and (args.port or not args.server or args.source != "gpuscope-server"):
        parser.error("--stack.port, --no-stack.server and --stack.source are for the single-host stack; "
                     "with --stack.hosts use --stack.free-ports")
    components = [c for c in COMPONENTS if c != "server" or args.server]
    try:
        root = find_root(args.root)
    except StackError as exc:
        parser.error(str(exc))
    options = StackOptions(profile=args.profile, ports=ports, host=args.host, run_dir=Path(args.run_dir),
                           server_args=server_args, components=components, root=root, source=args.source)
    # SIGINT and SIGTERM (Ctrl-C, kill, docker stop, systemd) stop the parts alike, whatever the
    # parent left them as.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    try:
        if not args.keep_data:
            for path in clear_data(Path(args.run_dir)):
                sys.stderr.write(f"gpuscope stack: removed {path} of the last run (--stack.keep-data "
                                 "keeps it)\n")
        stack: Stack | Fleet = Stack(options) if not args.hosts else _fleet(args, server_args)
        with stack:
            print(stack.summary(), flush=True)
            while not (dead := stack.dead()):
                threading.Event().wait(1.0)
            for name in dead:
                process = stack.processes[name]
                sys.stderr.write(f"gpuscope stack: {name} exited with status {process.poll()}; "
                                 f"see {process.log_path}\n")
            return 1
    except StackError as exc:
        sys.stderr.write(f"gpuscope stack: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("gpuscope stack: stopped\n")
        return 0
