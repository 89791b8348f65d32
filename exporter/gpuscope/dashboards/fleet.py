"""GPU fleet: what every GPU is doing and how healthy it is, from ``gpuscope exporter``."""

from gpuscope import catalogue as m
from gpuscope.dashboards import uids
from gpuscope.dashboards.common import (
                    PromTarget,
                    dashboard,
                    gpu_var,
                    heatmap,
                    instance_var,
                    rate_expr,
                    sel,
                    stat,
                    table,
                    timeseries,
)

G = "{{instance}} gpu {{gpu}}"

dashboard = dashboard(
    uid=uids.FLEET,
    title="gpuscope / GPU fleet",
    description="Utilization, memory, temperature, power, clocks, throttle reasons and XIDs of every GPU.",
    tags=["gpu"],
    variables=[instance_var(), gpu_var()],
    panels=[
        stat("GPUs seen", PromTarget(f"sum({sel(m.EXPORTER_GPUS, labels=['instance'])})"),
             description="GPUs and MIG instances the exporters see (0 on a machine without a GPU)."),
        stat("GPUs answering", PromTarget(f"sum({sel(m.EXPORTER_GPU_UP)})"),
             description="GPUs that answered their last fast sampling round."),
        stat("Mean utilization", PromTarget(f"avg({sel(m.GPU_UTILIZATION)})"), unit="percentunit"),
        stat("Power draw", PromTarget(f"sum({sel(m.GPU_POWER)})"), unit="watt"),
        stat("XIDs in range", PromTarget(f"sum(increase({sel(m.GPU_XID_ERRORS)}[$__range]))"),
             description="XID errors of every code over the dashboard's time range."),
        stat("Oldest cached value", PromTarget(f"max({sel(m.EXPORTER_STALENESS)})"), unit="s",
             description="Age of the NVML state the exporter serves; scrapes never wait on NVML."),
        heatmap("Utilization across GPUs", sel(m.GPU_UTILIZATION), unit="percentunit", calculate=True, w=24,
                description="How many GPUs sit at each utilization over time (Grafana buckets the values)."),
        timeseries("GPU utilization", PromTarget(sel(m.GPU_UTILIZATION), G), unit="percentunit"),
        timeseries("Memory bandwidth utilization", PromTarget(sel(m.GPU_MEMORY_UTILIZATION), G),
                   unit="percentunit"),
        timeseries("Framebuffer memory used", PromTarget(sel(m.GPU_MEMORY_USED), G),
                   PromTarget(sel(m.GPU_MEMORY_TOTAL), G + " total"), unit="bytes"),
        timeseries("Temperature", PromTarget(sel(m.GPU_TEMPERATURE), G),
                   PromTarget(sel(m.GPU_MEMORY_TEMPERATURE), G + " HBM"), unit="celsius"),
        timeseries("Power", PromTarget(sel(m.GPU_POWER), G),
                   PromTarget(sel(m.GPU_POWER_LIMIT), G + " limit"), unit="watt"),
        timeseries("Clocks", PromTarget(sel(m.GPU_SM_CLOCK), G + " SM"),
                   PromTarget(sel(m.GPU_MEMORY_CLOCK), G + " memory"), unit="hertz"),
        timeseries("Throttle reasons (share of time)",
                   PromTarget(rate_expr(m.GPU_CLOCK_EVENT_SECONDS, by=["instance", "gpu", "reason"]),
                              G + " {{reason}}"),
                   unit="percentunit", stack=True,
                   description="Share of each interval spent with each clock event (throttle) reason."),
        timeseries("Performance state", PromTarget(sel(m.GPU_PSTATE), G),
                   description="0 = P0 (fastest) … 15 = P15."),
        table("XID errors per GPU",
              PromTarget(f"sum by (instance, gpu, xid) (increase({sel(m.GPU_XID_ERRORS)}[$__range])) > 0",
                         instant=True, format="table"),
              description="Counts over the time range; a repeat shows up as a growing count, not a "
                          "last-value gauge."),
        timeseries("ECC errors and PCIe replays",
                   PromTarget(rate_expr(m.GPU_ECC_ERRORS, by=["instance", "gpu", "type"]),
                              G + " ECC {{type}}"),
                   PromTarget(rate_expr(m.GPU_PCIE_REPLAY, by=["instance", "gpu"]), G + " PCIe replay"),
                   unit="ops"),
        timeseries("Exporter sampling cost",
                   PromTarget(f"max by (instance, collector) "
                              f"({sel(m.EXPORTER_COLLECTION_SECONDS, labels=['instance'])})",
                              "{{instance}} {{collector}}"), unit="s",
                   description="Duration of the last NVML sampling round per collector (off the scrape "
                               "path)."),
        timeseries("NVML call errors",
                   PromTarget(rate_expr(m.EXPORTER_ERRORS, by=["instance", "call"]), "{{instance}} {{call}}"),
                   unit="ops"),
    ],
)
