"""Grafana uids: the dashboards', which the alerts' dashboard links name, and the datasources', which
every panel, the exemplar links and each deployment's datasource provisioning name.

Fixed uids keep dashboards and links portable between compose, the fleet and Kubernetes.
"""

# --- dashboards ---------------------------------------------------------------------------------------
FLEET = "gpuscope-fleet"
KERNELS = "gpuscope-kernels"
SLO = "gpuscope-slo"
TENANTS = "gpuscope-tenants"
BOTTLENECKS = "gpuscope-bottlenecks"
LOGS = "gpuscope-logs"

ALL = (FLEET, KERNELS, SLO, TENANTS, BOTTLENECKS, LOGS)

# --- datasources ----------------------------------------------------------------------------------------
#: Prometheus' query API: Prometheus in compose and Kubernetes, VictoriaMetrics in the fleet.
PROMETHEUS_DATASOURCE = "gpuscope-prometheus"
LOKI_DATASOURCE = "gpuscope-loki"
ALERTMANAGER_DATASOURCE = "gpuscope-alertmanager"
#: Grafana Tempo (compose: deploy/grafana/provisioning/datasources/tempo.yml, docs/tracing.md).
TEMPO_DATASOURCE = "gpuscope-tempo"
