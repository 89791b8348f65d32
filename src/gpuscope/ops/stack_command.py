"""``gpuscope stack``: the compose stack from local binaries (gpuscope.ops.stack), or with
``--stack.hosts N`` a fleet of N hosts on this machine (gpuscope.ops.fleet). It waits until every
part is healthy, prints where each listens, and stops them all on Ctrl-C (SIGINT) or SIGTERM, also
when started with SIGINT ignored (``gpuscope stack &`` in a script).
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from gpuscope.contract.choices import AlertProfile, ServerSource
from gpuscope.contract.parts import LOCAL_HOST
from gpuscope.ops.fleet import MAX_HOSTS, Fleet, FleetOptions
from gpuscope.ops.stack import COMPONENTS, Stack, StackError, StackOptions, evaluation_interval, find_root
from gpuscope.util.settings import SettingsParser, parser_for, setting


def _part_port(item: str) -> tuple[str, int]:
    """``PART=PORT`` (one ``--stack.port``) → (part, port)."""
    name, sep, value = item.partition("=")
    if not sep or name not in COMPONENTS or not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"{item!r} is not PART=PORT with PART one of {', '.join(COMPONENTS)}")
    return name, int(value)


def _host_count(text: str) -> int:
    if not text.strip().isdigit() or int(text) > MAX_HOSTS:
        raise ValueError(f"{text!r} is not a number of hosts from 0 (no fleet) to {MAX_HOSTS}")
    return int(text)


@dataclass(frozen=True)
class StackSettings:
    """The flags of ``gpuscope stack`` (those after ``--`` go to ``gpuscope serve``)."""

    profile: AlertProfile = setting("--stack.profile", AlertProfile.PRODUCTION, "alert rule profile: "
                                    f"production, or test (compressed windows, rules evaluated every "
                                    f"{evaluation_interval(AlertProfile.TEST)})")
    run_dir: Path = setting("--stack.run-dir", Path(".stack"),
                            "directory for rendered configs, data and logs", parse=Path)
    keep_data: bool = setting("--stack.keep-data", False, "keep the stored series and alerts of the last run "
                              "in the run dir (default: start with none, so no old series shows up)")
    host: str = setting("--stack.host", LOCAL_HOST, "address every part listens on")
    root: Path | None = setting("--stack.root", None, "the gpuscope checkout whose configuration files to "
                                "run with (default: the one at or above the current directory)", parse=Path)
    free_ports: bool = setting("--stack.free-ports", False,
                               "pick a free port for every part instead of the defaults")
    ports: tuple[tuple[str, int], ...] = setting(
        "--stack.port", (), "listen port of one part (repeatable; the variable takes several separated by "
        "spaces), e.g. server=18000", parse=_part_port, metavar="PART=PORT", repeated=True)
    source: ServerSource = setting(
        "--stack.source", ServerSource.GPUSCOPE, "the server's metrics: gpuscope's, or vllm (the server "
        "exposes vLLM's names, is scraped as job vllm, and the rules read them through the vLLM source)")
    server: bool = setting("--stack.server", True,
                           "start the reference server (--no-stack.server: run your own on its port)")
    hosts: int = setting("--stack.hosts", 0, "run the fleet profile instead (docs/fleet.md): N hosts of "
                         "server, exporter, node_exporter and vmagent remote-writing to one VictoriaMetrics, "
                         "with vmalert, Alertmanager and the receiver", parse=_host_count, metavar="N")


def _parser() -> SettingsParser[StackSettings]:
    return parser_for(StackSettings, prog="gpuscope stack", description=(
        "Start server, exporter, receiver, Prometheus, Alertmanager and node_exporter from local binaries "
        "with the compose stack's configuration. Flags after `--` go to `gpuscope serve`."))


def _fleet(args: StackSettings, server_args: list[str]) -> Fleet:
    """``--stack.hosts N``: the same command runs gpuscope.ops.fleet, with the same ports, run
    directory, profile and server flags."""
    return Fleet(FleetOptions(hosts=args.hosts, profile=args.profile, address=args.host,
                              ports="free" if args.free_ports else "default", run_dir=args.run_dir,
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
    args = parser.parse_settings(argv)
    ports: str | dict[str, int] = "free" if args.free_ports else dict(args.ports) or "default"
    if args.hosts and (args.ports or not args.server or args.source != ServerSource.GPUSCOPE):
        parser.error("--stack.port, --no-stack.server and --stack.source are for the single-host stack; "
                     "with --stack.hosts use --stack.free-ports")
    components = [c for c in COMPONENTS if c != "server" or args.server]
    try:
        root = find_root(args.root)
    except StackError as exc:
        parser.error(str(exc))
    options = StackOptions(profile=args.profile, ports=ports, host=args.host, run_dir=args.run_dir,
                           server_args=server_args, components=components, root=root, source=args.source)
    # SIGINT and SIGTERM (Ctrl-C, kill, docker stop, systemd) stop the parts alike, whatever the
    # parent left them as.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    try:
        if not args.keep_data:
            for path in clear_data(args.run_dir):
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
