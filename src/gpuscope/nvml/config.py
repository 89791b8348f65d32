"""Flags of ``gpuscope exporter``, validated in one place into a :class:`Config`.

Every flag is also an environment variable (``--sampling.interval`` ↔
``GPUSCOPE_SAMPLING_INTERVAL``); a bad value prints one line and exits with status 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuscope.contract.parts import default_listen_address
from gpuscope.nvml.collector_table import registered
from gpuscope.util.bounded_http import max_connections_setting, read_timeout_setting
from gpuscope.util.flags import parse_duration, parse_listen_address
from gpuscope.util.settings import LogLevel, SettingsParser, parser_for, setting, toggles

PROG = "gpuscope exporter"

#: Collector toggles and their defaults, from the collectors' own registrations. Opt-in ones cost
#: more (PCIe throughput: two of NVML's slowest calls per GPU per round, docs/design.md "NVML and
#: nvidia-smi") or expose PIDs and container ids, which not every operator wants on /metrics.
COLLECTORS: dict[str, tuple[bool, str]] = {name: (r.default, r.help) for name, r in registered().items()}


def _positive_int(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a whole number")
    value = int(text)
    if value < 1:
        raise ValueError(f"{text!r} must be at least 1")
    return value


@dataclass(frozen=True)
class Config:
    """Every setting of ``gpuscope exporter``, each field its flag."""

    listen: tuple[str, int] = setting(
        "--web.listen-address", parse_listen_address(default_listen_address("exporter")),
        "where to serve /metrics (containers: 0.0.0.0 and the same port)", parse=parse_listen_address,
        metavar="HOST:PORT")
    interval: float = setting("--sampling.interval", 1.0, "fast sampling interval (default 1s)",
                              parse=parse_duration, metavar="DURATION")
    slow_interval: float = setting(
        "--sampling.slow-interval", 10.0, "interval for expensive calls: energy, processes, PCIe, NVLink "
        "(default 10s)", parse=parse_duration, metavar="DURATION")
    call_timeout: float = setting(
        "--nvml.call-timeout", 2.0, "longest wait for one GPU's calls in a round; then its values go stale "
        "(default 2s)", parse=parse_duration, metavar="DURATION")
    processes_max: int = setting(
        "--processes.max", 32, "most processes exported per GPU, largest memory first (default 32)",
        parse=_positive_int, metavar="N")
    #: kubelet PodResources socket; "" = no pod attribution
    pod_resources_socket: str = setting(
        "--kubernetes.pod-resources-socket", "", "kubelet PodResources socket (Kubernetes: "
        "/var/lib/kubelet/pod-resources/kubelet.sock): adds namespace, pod and container of the GPU's pod to "
        "GPU series (default off)", metavar="PATH")
    log_level: LogLevel = setting("--log.level", LogLevel.INFO, "log level (default info)")
    #: The HTTP server's connection limits (``nvml.http.ExporterServer``).
    max_connections: int = max_connections_setting()
    read_timeout: float = read_timeout_setting()
    collectors: frozenset[str] = toggles("collector", COLLECTORS)


def build_parser() -> SettingsParser[Config]:
    return parser_for(Config, prog=PROG, description="NVML node exporter: GPU metrics on /metrics, "
                                                          "sampled in the background.")


def parse(argv: list[str]) -> Config:
    """Config from flags and environment; exits 2 with one line on a bad value."""
    parser = build_parser()
    config = parser.parse_settings(argv)
    if config.call_timeout > 60:
        parser.error(f"--nvml.call-timeout {config.call_timeout:g}s is over a minute; "
                     "values would be stale that long")
    return config
