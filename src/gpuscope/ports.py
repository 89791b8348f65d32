"""Where each part of the stack listens: the one source of these port numbers.

``gpuscope stack`` starts parts on these ports, ``docker-compose.yml`` and
``deploy/prometheus/prometheus.yml`` use them (a test keeps both in step), and
each command's default ``--web.listen-address`` takes its port from here.
Keys are the compose service names, which are also the host names that
Prometheus, Alertmanager and Loki use inside compose.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable

PORTS: dict[str, int] = {
    "server": 8000,
    "exporter": 9400,
    "receiver": 9095,
    "node-exporter": 9100,
    "prometheus": 9090,
    "alertmanager": 9093,
    "loki": 3100,
    "grafana": 3000,
    "locust": 8089,
}

#: ``gpuscope share``'s /metrics: a per-node controller, not a compose service (hence not in PORTS).
SHARE_PORT = 9402

#: Default host: local only. Containers listen on 0.0.0.0 inside their own network namespace instead.
LOCAL_HOST = "127.0.0.1"


def default_listen_address(service: str) -> str:
    """``127.0.0.1:PORT`` for a service's default ``--web.listen-address``."""
    return f"{LOCAL_HOST}:{PORTS[service]}"


def free_port(host: str = LOCAL_HOST) -> int:
    """A TCP port that was free on ``host`` a moment ago (the caller binds it right after)."""
    return free_ports(["port"], host)["port"]


def free_ports(names: Iterable[str], host: str = LOCAL_HOST) -> dict[str, int]:
    """A distinct TCP port per name, each free on ``host`` a moment ago.

    Every socket stays bound until all ports are chosen: ports asked for one at a time, each socket
    closed before the next bind, can come back twice (a stack once gave its receiver the port its
    Alertmanager had just been given)."""
    with contextlib.ExitStack() as held:
        ports = {}
        for name in names:
            sock = held.enter_context(socket.socket())
            sock.bind((host, 0))
            ports[name] = sock.getsockname()[1]
        return ports
