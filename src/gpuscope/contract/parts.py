"""The bundle's parts: one table of what each is called where, and where it listens.

A part's ``name`` is its compose service, which is also its host name inside compose and the name
``gpuscope stack`` and the fleet give it; ``port`` is its default listen port; ``job`` the Prometheus
scrape job that reads it (and the name of its source in the alert rules); ``service`` the ``service``
label of its alerts, log stream and spans, and the name of its Kubernetes workload.

``gpuscope stack`` starts parts on these ports, each command's default ``--web.listen-address`` takes
its port from here, and ``docker-compose.yml``, ``deploy/prometheus/prometheus.yml`` and
``deploy/fleet/`` use the same names and ports (tests keep them in step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    name: str
    #: Default listen port; None for programs the bundle reads but does not run.
    port: int | None
    #: Prometheus scrape job; empty when the bundle's Prometheus does not scrape it.
    job: str = ""
    #: ``service`` label of its alerts, logs and spans; empty where it has none.
    service: str = ""
    #: A service of docker-compose.yml (``PORTS``); the others run per node or in the fleet only.
    compose: bool = True


SERVER = Part("server", 8000, job="gpuscope-server", service="gpuscope-server")
EXPORTER = Part("exporter", 9400, job="gpuscope-exporter", service="gpuscope-exporter")
RECEIVER = Part("receiver", 9095, job="gpuscope-receiver", service="gpuscope-receiver")
NODE_EXPORTER = Part("node-exporter", 9100, job="node")
PROMETHEUS = Part("prometheus", 9090, job="prometheus")
ALERTMANAGER = Part("alertmanager", 9093, job="alertmanager")
LOKI = Part("loki", 3100)
GRAFANA = Part("grafana", 3000)
LOCUST = Part("locust", 8089)
#: ``gpuscope share``'s /metrics: a per-node controller, not a compose service.
SHARE_PORT = 9402
SHARE = Part("share", SHARE_PORT, job="gpuscope-share", compose=False)
#: The fleet profile's own parts (deploy/fleet/), on VictoriaMetrics' default ports.
VICTORIA_METRICS = Part("victoria-metrics", 8428, compose=False)
VMAGENT = Part("vmagent", 8429, compose=False)
VMALERT = Part("vmalert", 8880, compose=False)
#: Other programs whose metrics the rules read in the server and GPU roles (gpuscope.alerting.sources):
#: their default scrape jobs. The bundle does not run them.
VLLM = Part("vllm", None, job="vllm", compose=False)
DCGM_EXPORTER = Part("dcgm-exporter", None, job="dcgm-exporter", compose=False)

PARTS: tuple[Part, ...] = (SERVER, EXPORTER, RECEIVER, NODE_EXPORTER, PROMETHEUS, ALERTMANAGER, LOKI, GRAFANA,
                           LOCUST, SHARE, VICTORIA_METRICS, VMAGENT, VMALERT, VLLM, DCGM_EXPORTER)

#: Default port of every compose service, by service name.
PORTS: dict[str, int] = {p.name: p.port for p in PARTS if p.compose and p.port is not None}
#: Default ports of the fleet's own parts.
FLEET_PORTS: dict[str, int] = {p.name: p.port for p in (VICTORIA_METRICS, VMAGENT, VMALERT)
                               if p.port is not None}

#: Default host: local only. Containers listen on 0.0.0.0 inside their own network namespace instead.
LOCAL_HOST = "127.0.0.1"


def default_listen_address(service: str) -> str:
    """``127.0.0.1:PORT`` for a compose service's default ``--web.listen-address``."""
    return f"{LOCAL_HOST}:{PORTS[service]}"
