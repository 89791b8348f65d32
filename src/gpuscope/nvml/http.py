"""The exporter's HTTP endpoints: ``/metrics``, ``/`` and ``/healthz`` on the bounded metrics server
(``util/metrics_http.py``), its closed connections counted in
``gpuscope_exporter_http_connections_closed_total{reason}``."""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpuscope.contract import catalogue as cat
from gpuscope.util.bounded_http import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT
from gpuscope.util.metrics_http import MetricsServer, page

__all__ = ["DEFAULT_MAX_CONNECTIONS", "DEFAULT_READ_TIMEOUT", "ExporterServer"]

PAGE = page("gpuscope exporter", "NVML GPU metrics, sampled in the background.")


class ExporterServer(MetricsServer):
    """The exporter's endpoints."""

    def __init__(self, address: tuple[str, int], metrics: Callable[[str], tuple[bytes, str]],
                 health: Callable[[], dict], *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
        super().__init__(address, metrics, health, page=PAGE,
                         closed_metric=cat.EXPORTER_HTTP_CONNECTIONS_CLOSED,
                         log=logging.getLogger("gpuscope.exporter"), max_connections=max_connections,
                         read_timeout=read_timeout)
