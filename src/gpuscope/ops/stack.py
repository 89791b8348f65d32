"""``gpuscope stack``: the compose stack without Docker, from local binaries.

Starts the reference server, the NVML exporter, the alert receiver, Prometheus,
Alertmanager and node_exporter (Debian packages ``prometheus``,
``prometheus-alertmanager``, ``prometheus-node-exporter``) with the SAME
configuration files as ``docker-compose.yml``: ``deploy/prometheus/prometheus.yml``
and ``alerts/alertmanager.yml``, with only the compose ``SERVICE:PORT`` addresses
rewritten to local ones, into a run directory. It waits for every part to be
healthy, prints where each listens, and stops them all on Ctrl-C (SIGINT) or SIGTERM, also when
started with SIGINT ignored (``gpuscope stack &`` in a script). The command starts with no stored
data from an earlier run in its run directory (``--stack.keep-data`` keeps it).

Tests and scripts use it as a context manager (docs/stack.md)::

    with Stack(StackOptions(profile="test", ports="free")) as stack:
        requests.get(stack.url("prometheus") + "/api/v1/query", params={"query": "up"})

Loki and Grafana are not part of it: neither is packaged for Debian.

The command itself is ``stack_command``: with ``--stack.hosts N`` it runs gpuscope.ops.fleet instead,
N "hosts" on this machine, each remote-writing through its own agent to one central VictoriaMetrics
(docs/fleet.md). The fleet builds on this module: a Stack per host and one for the central
Alertmanager and receiver, started with ``launch()``, and the process helpers below
(``find_binary``, ``Process``, ``wait_healthy``, ``stop_processes``), built on gpuscope.ops.procs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import yaml

from gpuscope.alerting import generate, sources
from gpuscope.alerting.sources import STACK_SERVER_FLAGS
from gpuscope.contract import parts, profiles
from gpuscope.contract.choices import AlertProfile, ServerSource
from gpuscope.contract.parts import LOCAL_HOST, PORTS
from gpuscope.ops import procs
from gpuscope.util.flags import env_name
from gpuscope.util.freeport import free_ports

PROFILES: tuple[AlertProfile, ...] = tuple(AlertProfile)

#: Parts the stack runs, in start order (stopped in reverse).
COMPONENTS: tuple[str, ...] = (
    "receiver", "alertmanager", "node-exporter", "exporter", "server", "prometheus")

#: Debian binary names first, upstream names second; the package to install when none is found.
BINARIES: dict[str, tuple[tuple[str, ...], str]] = {
    "prometheus": (("prometheus",), "prometheus"),
    "alertmanager": (("prometheus-alertmanager", "alertmanager"), "prometheus-alertmanager"),
    "node-exporter": (("prometheus-node-exporter", "node_exporter"), "prometheus-node-exporter"),
}

#: What "healthy" means for each part: a 200 from this path.
HEALTH_PATHS: dict[str, str] = {
    "server": "/readyz",
    "exporter": "/metrics",
    "receiver": "/healthz",
    "node-exporter": "/metrics",
    "prometheus": "/-/ready",
    "alertmanager": "/-/ready",
}

#: Tenants the stack's server serves: the compose file's server command lists the same ones
#: (tests/test_readme_quickstart.py keeps them in step). ``default`` comes first, so requests without
#: ``X-Tenant`` and the load tests' default tenant are served; ``alpha`` and ``beta`` are the tenants of
#: README's quick start and the docs' examples. ``-- --tenants ...`` (or ``GPUSCOPE_TENANTS``) replaces them.
SERVER_TENANTS = "default:0.5:normal,alpha:0.3:high,beta:0.2:low"

class StackError(RuntimeError):
    """The stack cannot start; the message is one line naming the part and the reason."""


#: Files of a checkout that the stack runs with (as compose does): their folder is the root.
ROOT_MARKERS = ("deploy/prometheus/prometheus.yml", "alerts/alertmanager.yml")


def find_root(start: Path | None = None) -> Path:
    """The gpuscope checkout at or above ``start`` (default: the current directory) whose
    configuration files the stack runs with; StackError when there is none."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if all((candidate / marker).is_file() for marker in ROOT_MARKERS):
            return candidate
    raise StackError(f"no gpuscope checkout at or above {here} (one holds {ROOT_MARKERS[0]}): "
                     "run from one, or pass --stack.root DIR")


# --- configuration templating ---------------------------------------------------------------------------


def localize(text: str, addresses: dict[str, str], ports: dict[str, int] = PORTS) -> str:
    """Rewrite compose ``SERVICE:PORT`` addresses (``ports``, default parts.PORTS) in ``text`` to
    ``addresses[SERVICE]``.

    Only a service name standing alone before its own default port is rewritten, so
    ``gpuscope-server:8000`` or ``server:1234`` stay as they are.
    """
    for service, address in addresses.items():
        pattern = rf"(?<![\w.-]){re.escape(service)}:{ports[service]}(?!\d)"
        text = re.sub(pattern, address, text)
    return text


#: Scrape jobs of compose profiles the stack does not run (compose finds their targets through Docker's
#: DNS): left out of the stack's prometheus.yml.
COMPOSE_PROFILE_JOBS: tuple[str, ...] = (parts.SHARE.job,)


def render_prometheus_config(text: str, addresses: dict[str, str], rule_files: Sequence[str],
                             evaluation_interval: str | None = None) -> str:
    """deploy/prometheus/prometheus.yml for local binaries: addresses, rule files, evaluation interval;
    without the jobs of compose profiles (COMPOSE_PROFILE_JOBS)."""
    config = yaml.safe_load(localize(text, addresses))
    config["scrape_configs"] = [job for job in config.get("scrape_configs") or []
                                if job["job_name"] not in COMPOSE_PROFILE_JOBS]
    config["rule_files"] = list(rule_files)
    if evaluation_interval:
        config.setdefault("global", {})["evaluation_interval"] = evaluation_interval
    return "# Rendered by gpuscope stack from deploy/prometheus/prometheus.yml; edit that file.\n" + \
        yaml.safe_dump(config, sort_keys=False)


def evaluation_interval(profile: str) -> str:
    """Prometheus's evaluation interval for ``profile``: the one its generated rule groups pin
    (``Profile.evaluation_interval``), written as the global too, so the rendered file says what runs."""
    return f"{profiles.PROFILES[profile].evaluation_interval}s"


def rule_dir(root: Path, profile: str) -> Path:
    """Directory of the Prometheus rule files of an alert profile (generated by gpuscope.alerting)."""
    return root / "alerts" / "prometheus" / profile


def alertmanager_source(root: Path, profile: str) -> Path:
    """The Alertmanager configuration of a profile (generated by gpuscope.alerting)."""
    name = "alertmanager.yml" if profile == AlertProfile.PRODUCTION else f"alertmanager-{profile}-profile.yml"
    return root / "alerts" / name


# --- processes --------------------------------------------------------------------------------------------


def find_binary(part: str, names: Sequence[str], package: str) -> str:
    """Path of the first of ``names`` on PATH; StackError naming the Debian package when none is."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise StackError(f"{part}: none of {', '.join(names)} is on PATH (Debian: apt-get install {package})")


def part_env() -> dict[str, str]:
    """The parts' environment: ours, with Python's output unbuffered (their logs keep up with them)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


class Process(procs.Child):
    """One part: a child logging to ``log_path``, healthy on a 200 from ``url + health_path``
    (default: HEALTH_PATHS[name]).

    Each part runs in its own session, so Ctrl-C reaches the stack only and it stops the parts in
    order; and dies with the stack, so a test run killed hard leaves no part behind.
    """

    def __init__(self, name: str, argv: list[str], url: str, log_path: Path, health_path: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(argv, name=name, env=env, log_path=log_path,
                         ready=url + (health_path or HEALTH_PATHS[name]), new_session=True,
                         die_with_parent=True)
        self.url = url


def wait_healthy(processes: dict[str, Process], timeout_s: float, log: Callable[[str], None]) -> None:
    """Poll until every process is healthy, logging each as it is; StackError (with the log's last
    lines) if one exits or is not healthy within ``timeout_s``. Keys name the processes in messages."""
    try:
        procs.wait_all(processes, timeout_s,
                       on_ready=lambda name, s: log(f"ready    {name:14s} {processes[name].url} ({s:.1f}s)"),
                       on_waiting=lambda names, s: log(f"waiting for {', '.join(names)} ({s:.0f}s)"))
    except procs.ChildError as exc:
        raise StackError(str(exc)) from None


def stop_processes(processes: dict[str, Process], timeout: float, log: Callable[[str], None]) -> None:
    """SIGTERM the running ones in reverse (start) order, SIGKILL what is left after ``timeout``."""
    names = {id(process): name for name, process in processes.items()}
    procs.stop_all(reversed(processes.values()), signal.SIGTERM, timeout,
                   on_kill=lambda p: log(f"{names[id(p)]} did not stop within {timeout:g}s; killing it"))


_P = TypeVar("_P", bound="Parts")


class Parts(ABC):
    """What a Stack and a Fleet share: named parts that a ``with`` block starts and stops, and that a
    failed start stops too, so nothing is left running whichever part failed."""

    processes: dict[str, Process]

    def __enter__(self: _P) -> _P:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every part and wait until all are healthy (StackError if one is not)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def dead(self) -> list[str]:
        """Parts that have exited since they came up."""
        return [name for name, p in self.processes.items() if p.poll() is not None]

    @abstractmethod
    def _start(self) -> None:
        """Start the parts in order and wait until they are healthy."""

    @abstractmethod
    def stop(self, timeout: float = 15.0) -> None:
        """Stop whatever runs (also after a failed start); idempotent."""


@dataclass
class StackOptions:
    """How to run the stack.

    ``ports``: ``"default"`` (parts.PORTS), ``"free"`` (a free port for every part, for tests),
    or a dict overriding some parts' ports. ``server_args`` are appended to ``gpuscope serve``
    (e.g. ``["--faults.enable", "--faults.token", "t"]``). ``run_dir`` None means a temporary
    directory removed on stop.
    """

    profile: AlertProfile = AlertProfile.PRODUCTION
    ports: str | dict[str, int] = "default"
    host: str = LOCAL_HOST
    run_dir: Path | None = None
    server_args: Sequence[str] = ()
    exporter_args: Sequence[str] = ()
    components: Sequence[str] = COMPONENTS
    root: Path = field(default_factory=find_root)
    health_timeout_s: float = 180.0
    #: The server's source (gpuscope.alerting.sources): gpuscope's, or vLLM's (the server exposes
    #: vLLM's metrics, is scraped as job vllm, and Prometheus loads the vLLM layer).
    source: ServerSource = ServerSource.GPUSCOPE


class Stack(Parts):
    """The running stack; a context manager. ``url(part)`` is where a part listens."""

    def __init__(self, options: StackOptions | None = None, log: Callable[[str], None] | None = None) -> None:
        self.options = options or StackOptions()
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        if self.options.profile not in PROFILES:
            raise StackError(f"profile {self.options.profile!r} is not one of {', '.join(PROFILES)}")
        unknown = set(self.options.components) - set(COMPONENTS)
        if unknown:
            raise StackError(f"unknown parts {sorted(unknown)}; parts are {', '.join(COMPONENTS)}")
        self.ports = self._choose_ports()
        self._owns_run_dir = self.options.run_dir is None
        self.run_dir = Path(self.options.run_dir or tempfile.mkdtemp(prefix="gpuscope-stack-")).resolve()
        self.processes: dict[str, Process] = {}
        self._lock = threading.Lock()

    # -- public API --

    def url(self, part: str) -> str:
        """``http://HOST:PORT`` of a part (any of COMPONENTS)."""
        return f"http://{self._address(part)}"

    def _start(self) -> None:
        # Render configs, start every part, wait until all are healthy.
        self.launch()
        wait_healthy(self.processes, self.options.health_timeout_s, self._log)

    def launch(self) -> None:
        """Render configs and start every part without waiting for health (``start()`` waits; the
        fleet launches several stacks and then waits for all their parts at once). On an exception
        the caller must ``stop()``."""
        self.render_configs()
        for name in self.options.components:
            self.processes[name] = process = self._process(name)
            self._log(f"starting {name:14s} {' '.join(process.argv)}")
            process.start()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every part in reverse start order, SIGKILL what is left after ``timeout``."""
        with self._lock:
            stop_processes(self.processes, timeout, self._log)
            self.processes.clear()
            if self._owns_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def summary(self) -> str:
        """Where each part listens, one line each."""
        lines = [f"  {name:14s} {self.url(name)}" for name in self.processes]
        return "\n".join(["gpuscope stack is up (Ctrl-C stops it):", *lines,
                          f"  run dir        {self.run_dir} (configs and logs/)"])

    # -- internals --

    def _choose_ports(self) -> dict[str, int]:
        ports = {name: PORTS[name] for name in COMPONENTS}
        chosen = self.options.ports
        if chosen == "free":
            ports = free_ports(COMPONENTS, self.options.host)
        elif isinstance(chosen, dict):
            unknown = set(chosen) - set(COMPONENTS)
            if unknown:
                raise StackError(f"ports given for unknown parts {sorted(unknown)}")
            ports.update(chosen)
        elif chosen != "default":
            raise StackError(f"ports must be 'default', 'free' or a dict, not {chosen!r}")
        return ports

    def _address(self, part: str) -> str:
        host = self.options.host
        return f"[{host}]:{self.ports[part]}" if ":" in host else f"{host}:{self.ports[part]}"

    def render_configs(self) -> None:
        """Write prometheus.yml and alertmanager.yml for local addresses into the run directory
        (each only when its part is one of the stack's components, as it is by default)."""
        root = self.options.root
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        addresses = {name: self._address(name) for name in COMPONENTS}
        prometheus_src = root / "deploy" / "prometheus" / "prometheus.yml"
        am_src = alertmanager_source(root, self.options.profile)
        wanted = {"prometheus": prometheus_src, "alertmanager": am_src}
        for part, path in wanted.items():
            if part in self.options.components and not path.exists():
                raise StackError(f"{path} is missing (run from a gpuscope checkout, or pass its root)")
        if "prometheus" in self.options.components:
            rules = rule_dir(root, self.options.profile)
            interval = evaluation_interval(self.options.profile)
            text, files = prometheus_src.read_text(), [str(rules / "*.yml")]
            if self.options.source != ServerSource.GPUSCOPE:
                text, files = self._other_source(text)
            (self.run_dir / "prometheus.yml").write_text(render_prometheus_config(
                text, addresses, files, interval))
        if "alertmanager" in self.options.components:
            (self.run_dir / "alertmanager.yml").write_text(
                f"# Rendered by gpuscope stack from {am_src.relative_to(root)}; edit that file.\n"
                + localize(am_src.read_text(), addresses))

    def _other_source(self, text: str) -> tuple[str, list[str]]:
        """prometheus.yml scraping the server under its source's job, and that source's rule files."""
        profile = profiles.PROFILES[self.options.profile]
        job = sources.stack_job(self.options.source, profile)
        files = generate.stack_rule_files(profile, self.options.source)
        return (text.replace(f"- job_name: {parts.SERVER.job}\n", f"- job_name: {job}\n", 1),
                [str(self.options.root / f) for f in files])

    def _binary(self, part: str) -> str:
        names, package = BINARIES[part]
        return find_binary(part, names, package)

    def _process(self, name: str) -> Process:
        listen = self._address(name)
        run = self.run_dir
        gpuscope = [sys.executable, "-m", "gpuscope"]
        if name == "server":
            # An explicit flag beats the environment, so GPUSCOPE_TENANTS, when set, keeps its say.
            tenants = [] if env_name("--tenants") in os.environ else ["--tenants", SERVER_TENANTS]
            argv = [*gpuscope, "serve", "--web.listen-address", listen, *tenants,
                    *STACK_SERVER_FLAGS[self.options.source], *self.options.server_args]
        elif name == "exporter":
            argv = [*gpuscope, "exporter", "--web.listen-address", listen, *self.options.exporter_args]
        elif name == "receiver":
            argv = [*gpuscope, "receiver", "--web.listen-address", listen]
        elif name == "prometheus":
            argv = [self._binary(name), f"--config.file={run / 'prometheus.yml'}",
                    f"--storage.tsdb.path={run / 'prometheus-data'}", f"--web.listen-address={listen}",
                    "--enable-feature=exemplar-storage", "--storage.tsdb.retention.time=2d"]
        elif name == "alertmanager":
            argv = [self._binary(name), f"--config.file={run / 'alertmanager.yml'}",
                    f"--storage.path={run / 'alertmanager-data'}", f"--web.listen-address={listen}",
                    "--cluster.listen-address="]  # no gossip port: several stacks can coexist
        else:
            argv = [self._binary(name), f"--web.listen-address={listen}"]
        return Process(name, argv, self.url(name), run / "logs" / f"{name}.log", env=part_env())
