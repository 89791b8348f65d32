"""Energy and cost per output token (alerting/energy.py's records), for the tenants dashboard: the
server's figure and each tenant's, where the tenant split exists (gpuscope serve's GPU seconds)."""

from grafanalib.core import Panel

from gpuscope.contract import names
from gpuscope.dashboards.common import PromTarget, filtered, timeseries

T = "tenant"


def panels() -> list[Panel]:
    return [
        timeseries("Energy per output token",
                   PromTarget(filtered(names.ENERGY_PER_OUTPUT_TOKEN), "{{instance}} server"),
                   PromTarget(filtered(names.TENANT_ENERGY_PER_OUTPUT_TOKEN, T), "{{instance}} {{tenant}}"),
                   unit="joule", w=12,
                   description="GPU energy (NVML or DCGM energy counter) per generated token. A server "
                               "gets its host's GPU energy split by output tokens; a tenant gets its "
                               "server's split by GPU-seconds share, over its own tokens. Idle power "
                               "counts: few tokens, many joules each."),
        timeseries("Cost per million output tokens",
                   PromTarget(filtered(names.COST_PER_MILLION_OUTPUT_TOKENS), "{{instance}} server"),
                   PromTarget(filtered(names.TENANT_COST_PER_MILLION_OUTPUT_TOKENS, T),
                              "{{instance}} {{tenant}}"),
                   w=12,
                   description="GPU-hours attributed as the energy is, times cost.gpu_hour of the alerting "
                               "profile (default 1: the panel then reads GPU-hours per million tokens)."),
    ]
