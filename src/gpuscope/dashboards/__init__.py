"""Grafana dashboards built with grafanalib: one module per dashboard, each defining ``dashboard``.

``gpuscope generate`` renders them into ``dashboards/json/<uid>.json`` (what compose and the
Kubernetes ConfigMaps provision) and writes Grafana's datasource provisioning from ``common``.
"""

#: The dashboard modules, in the order their JSON is written.
MODULES = ("fleet", "kernels", "slo", "tenants", "bottlenecks", "logs")
