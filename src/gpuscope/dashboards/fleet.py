"""GPU fleet: what every GPU is doing and how healthy it is, from the GPU source (gpuscope exporter or
dcgm-exporter) through its normalised series."""

from gpuscope.contract import names as n
from gpuscope.contract import uids
from gpuscope.dashboards.common import (
    PromTarget,
    dashboard,
    filtered,
    gpu_var,
    heatmap,
    instance_var,
    stat,
    sum_expr,
    table,
    timeseries,
)

G = "{{instance}} gpu {{gpu}}"


def per_gpu(name: str, legend: str = G) -> PromTarget:
    return PromTarget(filtered(name, "gpu"), legend)


dashboard = dashboard(
    uid=uids.FLEET,
    title="gpuscope / GPU fleet",
    description="Utilization, memory, temperature, power, clocks, throttle reasons and XIDs of every GPU, "
                "from gpuscope exporter or dcgm-exporter.",
    tags=["gpu"],
    variables=[instance_var(), gpu_var()],
    panels=[
        stat("GPUs seen", PromTarget(sum_expr(n.EXPORTER_GPUS)),
             description="GPUs and MIG instances the exporters see (0 on a machine without a GPU)."),
        stat("GPUs answering", PromTarget(sum_expr(n.EXPORTER_GPU_UP, "gpu")),
             description="GPUs that answered their last fast sampling round (gpuscope exporter)."),
        stat("Mean utilization", PromTarget(f"avg({filtered(n.GPU_UTILIZATION, 'gpu')})"),
             unit="percentunit"),
        stat("Power draw", PromTarget(sum_expr(n.GPU_POWER, "gpu")), unit="watt"),
        stat("GPUs with a recent XID", PromTarget(f"count({filtered(n.GPU_XID_RECENT, 'gpu')}) or vector(0)"),
             description="GPUs that reported an XID of any code within the XID alert's window."),
        stat("Oldest cached value", PromTarget(f"max({filtered(n.EXPORTER_STALENESS)})"), unit="s",
             description="Age of the NVML state gpuscope exporter serves; scrapes never wait on NVML."),
        heatmap("Utilization across GPUs", filtered(n.GPU_UTILIZATION, "gpu"), unit="percentunit",
                calculate=True, w=24,
                description="How many GPUs sit at each utilization over time (Grafana buckets the values)."),
        timeseries("GPU utilization", per_gpu(n.GPU_UTILIZATION), unit="percentunit",
                   description="gpuscope exporter: NVML utilization; dcgm-exporter: GR_ENGINE_ACTIVE where "
                               "profiling fields are on, else GPU_UTIL."),
        timeseries("Memory bandwidth utilization", per_gpu(n.GPU_MEMORY_UTILIZATION), unit="percentunit"),
        timeseries("Framebuffer memory used", per_gpu(n.GPU_MEMORY_USED),
                   per_gpu(n.GPU_MEMORY_TOTAL, G + " total"), unit="bytes"),
        timeseries("Temperature", per_gpu(n.GPU_TEMPERATURE),
                   per_gpu(n.GPU_MEMORY_TEMPERATURE, G + " HBM"), unit="celsius"),
        timeseries("Power", per_gpu(n.GPU_POWER), per_gpu(n.GPU_POWER_LIMIT, G + " limit"),
                   per_gpu(n.GPU_ENERGY_RATE, G + " from the energy counter"), unit="watt"),
        timeseries("Clocks", per_gpu(n.GPU_SM_CLOCK, G + " SM"),
                   per_gpu(n.GPU_MEMORY_CLOCK, G + " memory"), unit="hertz"),
        timeseries("Throttle reasons (share of time)",
                   PromTarget(filtered(n.GPU_CLOCK_EVENT_RATIO, "gpu"), G + " {{reason}}"),
                   unit="percentunit", stack=True,
                   description="Share of the throttle window spent with each clock event (throttle) reason."),
        timeseries("Performance state", per_gpu(n.GPU_PSTATE), description="0 = P0 (fastest) … 15 = P15."),
        table("Recent XIDs per GPU",
              PromTarget(f"max by (instance, gpu, xid) ({filtered(n.GPU_XID_RECENT, 'gpu')})", instant=True,
                         format="table"),
              description="XID codes each GPU reported within the XID alert's window."),
        timeseries("ECC errors and PCIe replays",
                   PromTarget(sum_expr(n.GPU_ECC_ERRORS_RATE, "gpu", by=["instance", "gpu", "type"]),
                              G + " ECC {{type}}"),
                   PromTarget(sum_expr(n.GPU_PCIE_REPLAY_RATE, "gpu", by=["instance", "gpu"]),
                              G + " PCIe replay"),
                   unit="ops"),
        timeseries("Exporter sampling cost",
                   PromTarget(f"max by (instance, collector) ({filtered(n.EXPORTER_COLLECTION_SECONDS)})",
                              "{{instance}} {{collector}}"), unit="s",
                   description="Duration of the last NVML sampling round per collector (off the scrape "
                               "path)."),
        timeseries("NVML call errors",
                   PromTarget(sum_expr(n.EXPORTER_ERRORS_RATE, by=["instance", "call"]),
                              "{{instance}} {{call}}"),
                   unit="ops"),
    ],
)
