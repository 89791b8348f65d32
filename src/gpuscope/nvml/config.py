"""Flags of ``gpuscope exporter``, validated in one place into a :class:`Config`.

Every flag is also an environment variable (``--sampling.interval`` ↔
``GPUSCOPE_SAMPLING_INTERVAL``); a bad value prints one line and exits with status 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuscope.contract.parts import default_listen_address
from gpuscope.nvml.collector_table import registered
from gpuscope.util.flags import FlagParser, parse_duration, parse_listen_address
from gpuscope.util.flags import checked as _checked

_DEFAULT_LISTEN = default_listen_address("exporter")

#: Collector toggles and their defaults, from the collectors' own registrations. Opt-in ones cost
#: more (PCIe: 2 × 20 ms per GPU per round) or expose PIDs and container ids, which not every
#: operator wants on /metrics.
COLLECTORS: dict[str, tuple[bool, str]] = {name: (r.default, r.help) for name, r in registered().items()}


def _listen(text: str) -> tuple[str, int]:
    return parse_listen_address(text)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a whole number")
    value = int(text)
    if value < 1:
        raise ValueError(f"{text!r} must be at least 1")
    return value


@dataclass(frozen=True)
class Config:
    listen: tuple[str, int] = parse_listen_address(_DEFAULT_LISTEN)
    collectors: frozenset[str] = frozenset(n for n, (on, _) in COLLECTORS.items() if on)
    interval: float = 1.0
    slow_interval: float = 10.0
    call_timeout: float = 2.0
    processes_max: int = 32
    log_level: str = "info"
    pod_resources_socket: str = ""  # kubelet PodResources socket; "" = no pod attribution


_duration = _checked(parse_duration)
_listen_flag = _checked(_listen)
_count = _checked(_positive_int)


def build_parser() -> FlagParser:
    p = FlagParser(prog="gpuscope exporter",
                   description="NVML node exporter: GPU metrics on /metrics, sampled in the background.")
    p.add_flag("--web.listen-address", dest="listen", type=_listen_flag, default=_listen(_DEFAULT_LISTEN),
               metavar="HOST:PORT", help="where to serve /metrics (containers: 0.0.0.0 and the same port)")
    p.add_flag("--sampling.interval", dest="interval", type=_duration, default=1.0,
               metavar="DURATION", help="fast sampling interval (default 1s)")
    p.add_flag("--sampling.slow-interval", dest="slow_interval", type=_duration, default=10.0,
               metavar="DURATION", help="interval for expensive calls: energy, processes, PCIe, NVLink "
                                        "(default 10s)")
    p.add_flag("--nvml.call-timeout", dest="call_timeout", type=_duration, default=2.0,
               metavar="DURATION", help="longest wait for one GPU's calls in a round; then its values "
                                        "go stale (default 2s)")
    p.add_flag("--processes.max", dest="processes_max", type=_count, default=32, metavar="N",
               help="most processes exported per GPU, largest memory first (default 32)")
    p.add_flag("--kubernetes.pod-resources-socket", dest="pod_resources_socket", default="",
               metavar="PATH", help="kubelet PodResources socket (Kubernetes: "
                                    "/var/lib/kubelet/pod-resources/kubelet.sock): adds namespace, pod and "
                                    "container of the GPU's pod to GPU series (default off)")
    p.add_flag("--log.level", dest="log_level", choices=("debug", "info", "warn", "error"), default="info",
               help="log level (default info)")
    for name, (default, text) in COLLECTORS.items():
        p.add_toggle(f"collector.{name}", default, f"{text} (default {'on' if default else 'off'})")
    return p


def parse(argv: list[str]) -> Config:
    """Config from flags and environment; exits 2 with one line on a bad value."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    collectors = frozenset(n for n in COLLECTORS if getattr(ns, f"collector.{n}"))
    if ns.call_timeout > 60:
        parser.error(f"--nvml.call-timeout {ns.call_timeout:g}s is over a minute; "
                     "values would be stale that long")
    return Config(listen=ns.listen, collectors=collectors, interval=ns.interval,
                  slow_interval=ns.slow_interval, call_timeout=ns.call_timeout,
                  processes_max=ns.processes_max,
                  log_level=ns.log_level, pod_resources_socket=ns.pod_resources_socket)
