"""The multi-host profile: every host's agent remote-writes to one central VictoriaMetrics.

On each host, ``vmagent`` scrapes the reference server, the NVML exporter, node_exporter and
itself, adds ``cluster`` and ``host`` as external labels and remote-writes to the central store,
buffering on disk while that is unreachable. Centrally, VictoriaMetrics stores the series and
answers Prometheus' query API (Grafana's datasource); ``vmalert`` evaluates the SAME generated rule
files as Prometheus (``alerts/prometheus/<profile>/``) against it, writes recording-rule results and
ALERTS back, and sends alerts to Alertmanager, configured with the same ``alerts/alertmanager*.yml``
as compose, which notifies the receiver. Configuration: ``deploy/fleet/`` (docs/fleet.md).

``gpuscope stack --stack.hosts N`` runs such a fleet on one machine for trying it out: N "hosts",
each a Stack of server, exporter and node_exporter plus its vmagent, and a central Stack of
Alertmanager and receiver plus VictoriaMetrics and vmalert. Processes are started, checked and
stopped with gpuscope.ops.stack's own helpers (on gpuscope.ops.procs). Tests use it as a context manager::

    with Fleet(FleetOptions(hosts=("hostA", "hostB"), profile="test", ports="free")) as fleet:
        requests.get(fleet.url("victoria-metrics") + "/api/v1/query", params={"query": "up"})
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpuscope.contract.choices import AlertProfile
from gpuscope.contract.parts import FLEET_PORTS, LOCAL_HOST, PORTS
from gpuscope.ops.stack import (
    Parts,
    Process,
    Stack,
    StackError,
    StackOptions,
    find_binary,
    find_root,
    localize,
    rule_dir,
    stop_processes,
    wait_healthy,
)
from gpuscope.util.freeport import free_ports

#: Every one of them comes from the Debian package victoria-metrics; all answer /health.
PACKAGE = "victoria-metrics"
HEALTH_PATH = "/health"

#: Stack parts that run on every host (each host also runs its vmagent), and centrally.
HOST_PARTS: tuple[str, ...] = ("node-exporter", "exporter", "server")
CENTRAL_PARTS: tuple[str, ...] = ("receiver", "alertmanager")
#: Parts with a URL of their own, central ones first (``url(part)``; host parts are ``HOST/part``).
CENTRAL_URLS: tuple[str, ...] = ("victoria-metrics", "vmalert", "alertmanager", "receiver")

#: With default ports, host i (from 0) listens on each default port + i × HOST_PORT_STEP.
HOST_PORT_STEP = 10
MAX_HOSTS = 20
DEFAULT_CLUSTER = "local"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,62}")


def fleet_dir(root: Path) -> Path:
    return root / "deploy" / "fleet"


def load_flags(root: Path) -> dict[str, list[str]]:
    """deploy/fleet/flags.yml: the flags of victoria-metrics, vmalert and vmagent."""
    flags = yaml.safe_load((fleet_dir(root) / "flags.yml").read_text())
    missing = set(FLEET_PORTS) - set(flags)
    if missing:
        raise StackError(f"deploy/fleet/flags.yml has no flags for {sorted(missing)}")
    return {part: [str(flag) for flag in flags[part]] for part in FLEET_PORTS}


def render(text: str, addresses: dict[str, str], cluster: str | None = None) -> str:
    """Compose-style addresses (parts.PORTS and parts.FLEET_PORTS) → ``addresses``; with ``cluster``,
    also %{GPUSCOPE_CLUSTER} (for flags: the binaries expand placeholders in files only)."""
    text = localize(text, addresses, {**PORTS, **FLEET_PORTS})
    return text.replace("%{GPUSCOPE_CLUSTER}", cluster) if cluster is not None else text


def host_names(hosts: int | Sequence[str]) -> list[str]:
    """``3`` → host1, host2, host3; or the names given (letters, digits, ``_.-``; unique)."""
    names = [f"host{i + 1}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
    if not 1 <= len(names) <= MAX_HOSTS:
        raise StackError(f"a fleet has 1 to {MAX_HOSTS} hosts, not {len(names)}")
    bad = [n for n in names if not _NAME.fullmatch(n) or n == "central"]
    if bad or len(set(names)) != len(names):
        raise StackError(f"host names must be unique, start with a letter and use letters, digits, "
                         f"'_', '.' or '-' (and not 'central'): {names}")
    return names


@dataclass
class FleetOptions:
    """How to run the fleet on one machine.

    ``hosts``: how many (named host1…hostN) or their names; each becomes the ``host`` label of its
    series. ``ports``: ``"default"`` (host i on each default port + 10 × i) or ``"free"``.
    ``run_dir`` None means a temporary directory removed on stop; inside it every host has its
    own directory and the central parts share ``central/``.
    """

    hosts: int | Sequence[str] = 2
    cluster: str = DEFAULT_CLUSTER
    profile: AlertProfile = AlertProfile.PRODUCTION
    ports: str = "default"
    address: str = LOCAL_HOST
    run_dir: Path | None = None
    server_args: Sequence[str] = ()
    exporter_args: Sequence[str] = ()
    root: Path = field(default_factory=find_root)
    health_timeout_s: float = 180.0


class Fleet(Parts):
    """The running fleet; a context manager. ``url("victoria-metrics")``, ``url("hostA/server")``."""

    def __init__(self, options: FleetOptions | None = None, log: Callable[[str], None] | None = None) -> None:
        self.options = options or FleetOptions()
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.names = host_names(self.options.hosts)
        if not _NAME.fullmatch(self.options.cluster):
            raise StackError(f"cluster name {self.options.cluster!r} is not a plain name")
        if self.options.ports not in ("default", "free"):
            raise StackError(f"ports must be 'default' or 'free', not {self.options.ports!r}")
        self.flags = load_flags(self.options.root)
        self._owns_run_dir = self.options.run_dir is None
        self.run_dir = Path(self.options.run_dir or tempfile.mkdtemp(prefix="gpuscope-fleet-")).resolve()
        try:
            self._plan()
        except BaseException:
            if self._owns_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self.processes: dict[str, Process] = {}

    def _plan(self) -> None:
        """The Stacks of the hosts and of the central parts, and every port."""
        free = self.options.ports == "free"
        # Free ports are chosen in one call for the whole fleet: chosen stack by stack, a port
        # released by one stack's choice can come back in the next (a host's node-exporter was
        # once given the central receiver's port).
        wanted = [*CENTRAL_PARTS, *(f"{h}/{p}" for h in self.names for p in HOST_PARTS),
                  "victoria-metrics", "vmalert", *(f"{h}/vmagent" for h in self.names)]
        chosen = free_ports(wanted, self.options.address) if free else {}

        def stack(parts: Sequence[str], directory: str, offset: int, prefix: str) -> Stack:
            key = "" if directory == "central" else f"{directory}/"
            ports = ({p: chosen[key + p] for p in parts} if free
                     else {p: PORTS[p] + offset for p in parts})
            return Stack(StackOptions(
                profile=self.options.profile, ports=ports, host=self.options.address,
                run_dir=self.run_dir / directory, server_args=self.options.server_args,
                exporter_args=self.options.exporter_args, components=parts, root=self.options.root,
                health_timeout_s=self.options.health_timeout_s),
                log=lambda line: self._log(f"{prefix}{line}"))

        self.central = stack(CENTRAL_PARTS, "central", 0, "")
        self.hosts = {name: stack(HOST_PARTS, name, i * HOST_PORT_STEP, f"{name}: ")
                      for i, name in enumerate(self.names)}
        self.ports = {"victoria-metrics": FLEET_PORTS["victoria-metrics"], "vmalert": FLEET_PORTS["vmalert"]}
        for i, name in enumerate(self.names):
            self.ports[f"{name}/vmagent"] = FLEET_PORTS["vmagent"] + i * HOST_PORT_STEP
        if free:
            self.ports = {part: chosen[part] for part in self.ports}
        self._check_ports()

    # -- public API --

    def url(self, part: str) -> str:
        """``http://HOST:PORT`` of a central part (CENTRAL_URLS) or of ``HOST/PART`` (a host's
        server, exporter, node-exporter or vmagent)."""
        return f"http://{self._address(part)}"

    def _start(self) -> None:
        # Render configs, start the central parts and then every host, wait until all are healthy.
        self.render_configs()
        self._start_own("victoria-metrics", self._victoria_metrics())
        # vmalert restores its alerts' `for:` state from the store when it starts: store first.
        wait_healthy(self.processes, self.options.health_timeout_s, self._log)
        self.central.launch()
        self.processes.update(self.central.processes)
        self._start_own("vmalert", self._vmalert())
        for name, stack in self.hosts.items():
            stack.launch()
            self.processes.update({f"{name}/{part}": p for part, p in stack.processes.items()})
            self._start_own(f"{name}/vmagent", self._vmagent(name))
        rest = {name: p for name, p in self.processes.items() if name != "victoria-metrics"}
        wait_healthy(rest, self.options.health_timeout_s, self._log)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every part, hosts first, in reverse start order (SIGKILL after ``timeout``)."""
        stop_processes(self.processes, timeout, self._log)
        self.processes.clear()
        for stack in [*self.hosts.values(), self.central]:
            stack.stop(timeout)  # parts it started before a failure that the fleet had not yet listed
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def stop_part(self, name: str, timeout: float = 15.0) -> None:
        """Stop one part (e.g. ``victoria-metrics`` for an outage, ``hostA/vmagent``); SIGTERM first."""
        stop_processes({name: self.processes[name]}, timeout, self._log)

    def start_part(self, name: str) -> None:
        """Start a stopped part again with its own command line and wait until it is healthy."""
        process = self.processes[name]
        if process.running:
            raise StackError(f"{name} is running")
        self._log(f"starting {name:22s} again")
        process.start()
        wait_healthy({name: process}, self.options.health_timeout_s, self._log)

    def summary(self) -> str:
        """Where each part listens, one line each (central parts first)."""
        notes = {"victoria-metrics": "  (Prometheus query API: Grafana's datasource)"}
        lines = [f"  {name:22s} {process.url}{notes.get(name, '')}"
                 for name, process in self.processes.items()]
        return "\n".join([
            f"gpuscope fleet is up: {len(self.names)} host(s) of cluster {self.options.cluster} "
            f"remote-writing to VictoriaMetrics (Ctrl-C stops it):", *lines,
            f"  {'run dir':22s} {self.run_dir} (central/ and one directory per host: configs, logs/)"])

    # -- internals --

    def _address(self, part: str) -> str:
        host, sep, local = part.partition("/")
        if sep and host in self.hosts and local in HOST_PARTS:
            return self.hosts[host].url(local).removeprefix("http://")
        if part in CENTRAL_PARTS:
            return self.central.url(part).removeprefix("http://")
        if part not in self.ports:
            raise StackError(f"no part {part!r}; parts: {', '.join(CENTRAL_URLS)}, HOST/server, "
                             f"HOST/exporter, HOST/node-exporter, HOST/vmagent")
        address = self.options.address
        return f"[{address}]:{self.ports[part]}" if ":" in address else f"{address}:{self.ports[part]}"

    def _check_ports(self) -> None:
        used: dict[int, str] = {}
        parts = [*CENTRAL_URLS, *(f"{h}/{p}" for h in self.names for p in (*HOST_PARTS, "vmagent"))]
        for part in parts:
            port = int(self._address(part).rsplit(":", 1)[1])
            if port in used:
                raise StackError(f"{part} and {used[port]} would both listen on port {port}; "
                                 f"use free ports (--stack.free-ports)")
            used[port] = part

    def _addresses(self, host: str | None = None) -> dict[str, str]:
        """Compose service name → local address, for the central parts and (given) one host's."""
        addresses = {part: self._address(part) for part in CENTRAL_URLS}
        if host is not None:
            addresses.update({part: self._address(f"{host}/{part}") for part in (*HOST_PARTS, "vmagent")})
        return addresses

    def render_configs(self) -> None:
        """Write each host's vmagent.yml and the central victoria-metrics.yml for local addresses."""
        source = fleet_dir(self.options.root)
        for path in (source / "vmagent.yml", source / "victoria-metrics.yml"):
            if not path.exists():
                raise StackError(f"{path} is missing (run from a gpuscope checkout, or pass its root)")
        header = "# Rendered by gpuscope stack --stack.hosts from deploy/fleet/{}; edit that file.\n"
        central = self.run_dir / "central"
        (central / "logs").mkdir(parents=True, exist_ok=True)
        (central / "victoria-metrics.yml").write_text(header.format("victoria-metrics.yml") + render(
            (source / "victoria-metrics.yml").read_text(), self._addresses()))
        for name in self.names:
            (self.run_dir / name / "logs").mkdir(parents=True, exist_ok=True)
            (self.run_dir / name / "vmagent.yml").write_text(header.format("vmagent.yml") + render(
                (source / "vmagent.yml").read_text(), self._addresses(name)))

    def _own_env(self, host: str | None = None) -> dict[str, str]:
        env = {**os.environ, "GPUSCOPE_CLUSTER": self.options.cluster}
        if host is not None:
            env["GPUSCOPE_HOST"] = host
        return env

    def _flags(self, binary: str, host: str | None = None) -> list[str]:
        return [render(flag, self._addresses(host), self.options.cluster) for flag in self.flags[binary]]

    def _victoria_metrics(self) -> tuple[list[str], dict[str, str]]:
        central = self.run_dir / "central"
        return [find_binary("victoria-metrics", ("victoria-metrics",), PACKAGE),
                f"-httpListenAddr={self._address('victoria-metrics')}",
                f"-storageDataPath={central / 'victoria-metrics-data'}",
                f"-promscrape.config={central / 'victoria-metrics.yml'}",
                *self._flags("victoria-metrics")], self._own_env()

    def _vmalert(self) -> tuple[list[str], dict[str, str]]:
        rules = rule_dir(self.options.root, self.options.profile)
        if not list(rules.glob("*.yml")):
            raise StackError(f"no rule files in {rules} (`gpuscope generate` writes them)")
        return [find_binary("vmalert", ("vmalert",), PACKAGE),
                f"-httpListenAddr={self._address('vmalert')}", f"-rule={rules / '*.yml'}",
                *self._flags("vmalert")], self._own_env()

    def _vmagent(self, host: str) -> tuple[list[str], dict[str, str]]:
        directory = self.run_dir / host
        return [find_binary("vmagent", ("vmagent",), PACKAGE),
                f"-httpListenAddr={self._address(f'{host}/vmagent')}",
                f"-promscrape.config={directory / 'vmagent.yml'}",
                f"-remoteWrite.tmpDataPath={directory / 'vmagent-queue'}",
                *self._flags("vmagent", host)], self._own_env(host)

    def _start_own(self, name: str, command: tuple[list[str], dict[str, str]]) -> None:
        argv, env = command
        directory = self.run_dir / (name.split("/")[0] if "/" in name else "central")
        log_name = name.rsplit("/", 1)[-1]
        process = Process(log_name, argv, self.url(name), directory / "logs" / f"{log_name}.log",
                          health_path=HEALTH_PATH, env=env)
        self.processes[name] = process
        self._log(f"starting {name:22s} {' '.join(argv)}")
        process.start()
