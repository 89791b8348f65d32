"""Free TCP ports for children started on loopback (stacks, fleets, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable

from gpuscope.contract.parts import LOCAL_HOST


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
