"""Logs and alerts: the server's logs in Loki filtered by the dashboard's variables, and firing alerts."""

from gpuscope.contract import catalogue as m
from gpuscope.contract import names, uids
from gpuscope.dashboards.common import (
                    SERVER_LOG_STREAM,
                    LokiTarget,
                    PromTarget,
                    dashboard,
                    instance_var,
                    logs,
                    stat,
                    sum_expr,
                    table,
                    tenant_var,
                    timeseries,
)

# Tenant, level and trace id are structured metadata (not stream labels), filtered after the selector.
FILTERED = SERVER_LOG_STREAM + ' | tenant=~"$tenant"'
#: The bundle's own alert receiver (not a source: the same whatever the server and GPU exporter).
NOTIFICATIONS = f"rate({m.RECEIVER_NOTIFICATIONS.name}[$__rate_interval])"
RECEIVED = f"sum({NOTIFICATIONS})"
RECEIVED_BY_STATUS = f"sum by (status) ({NOTIFICATIONS})"

dashboard = dashboard(
    uid=uids.LOGS,
    title="gpuscope / Logs and alerts",
    description="Structured request logs from Loki (one line per request and per error) next to the alerts "
                "Prometheus is firing and the notifications the receiver got.",
    tags=["logs", "alerts"],
    variables=[instance_var(), tenant_var()],
    panels=[
        stat("Alerts firing", PromTarget('count(ALERTS{alertstate="firing"}) or vector(0)'), w=6),
        stat("Notifications received / s", PromTarget(RECEIVED), unit="ops", w=6),
        stat("Log records dropped / s",
             PromTarget(f"{sum_expr(names.LOG_RECORDS_DROPPED_RATE)} or vector(0)"), w=6, unit="ops",
             description="Records the server's Loki handler drops (queue full, rejected, shutdown)."),
        stat("Log queue", PromTarget(sum_expr(names.LOG_QUEUE_RECORDS)), w=6,
             description="Records waiting to be pushed to Loki."),
        table("Firing alerts",
              PromTarget('ALERTS{alertstate="firing"}', instant=True, format="table"), w=24, h=7,
              exclude=("Time", "__name__", "Value", "alertstate"),
              description="What, where and how bad: one row per firing alert, with all its labels."),
        timeseries("Degradation dimensions",
                   PromTarget(f'max by (instance, dimension) ({names.DEGRADATION}{{instance=~"$instance"}})',
                              "{{instance}} {{dimension}}"), w=24, h=6,
                   description="1 while a dimension holds (latency spike, memory leak, starvation); two "
                               "or more at once fire the composite GPUServiceDegraded, which inhibits its "
                               "parts."),
        timeseries("Log lines by level",
                   LokiTarget(f"sum by (level) (count_over_time({FILTERED} [$__interval]))", "{{level}}"),
                   stack=True, w=12),
        timeseries("Notifications by status",
                   PromTarget(RECEIVED_BY_STATUS, "{{status}}"), unit="ops",
                   w=12),
        logs("Errors", f'{FILTERED} | level=~"error|critical"', h=8,
             description="Error lines only; each carries trace_id in its structured metadata."),
        logs("Server logs", FILTERED, description="Newest first; open a line for its trace_id, tenant and "
                                                  "latencies."),
    ],
)
