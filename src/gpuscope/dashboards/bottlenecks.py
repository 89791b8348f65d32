"""Bottlenecks: host CPU (node_exporter) against GPU utilization and memory, and the recorded class."""

from gpuscope.contract import names, uids
from gpuscope.contract.profiles import PRODUCTION
from gpuscope.dashboards.common import (
            PromTarget,
            dashboard,
            filtered,
            gpu_var,
            instance_var,
            stat,
            table,
            timeseries,
)

# Recorded by the alert rules (gpuscope.alerting.bottleneck): one series per host with value 1 and label
# class (memory_pressure, idle, gpu_bound, cpu_bound) for the class that holds now.
BOTTLENECK_CLASS = names.BOTTLENECK_CLASS
CPU_BUSY = ('1 - avg by (instance) (rate(node_cpu_seconds_total{mode="idle",instance=~"$instance"}'
            '[$__rate_interval]))')
HOST_MEMORY = ('1 - node_memory_MemAvailable_bytes{instance=~"$instance"}'
               ' / node_memory_MemTotal_bytes{instance=~"$instance"}')
GPU_BUSY = f"avg by (instance) ({filtered(names.GPU_UTILIZATION, 'gpu')})"
GPU_MEMORY = (f"sum by (instance) ({filtered(names.GPU_MEMORY_USED, 'gpu')})"
              f" / sum by (instance) ({filtered(names.GPU_MEMORY_TOTAL, 'gpu')})")

dashboard = dashboard(
    uid=uids.BOTTLENECKS,
    title="gpuscope / Bottlenecks",
    description="Is each machine CPU-bound, GPU-bound, under memory pressure or idle? Host CPU and memory "
                "from node_exporter next to GPU utilization and memory from the GPU source.",
    tags=["gpu", "node"],
    variables=[instance_var(), gpu_var()],
    panels=[
        table("Current class per host",
              PromTarget(f'{BOTTLENECK_CLASS}{{instance=~"$instance"}}', instant=True, format="table"),
              w=8, h=8, exclude=("Time", "__name__", "Value", "job"),
              description=f"From the recording rule {BOTTLENECK_CLASS}: memory pressure first, then idle, "
                          "then whichever of CPU and GPU is busier."),
        timeseries("Class over time",
                   PromTarget(f'max by (host, class) ({BOTTLENECK_CLASS}{{instance=~"$instance"}})',
                              "{{host}} {{class}}"), w=16, h=8, stack=True,
                   description="1 while the class holds; one colour per class."),
        timeseries("Classifier inputs (recorded)",
                   PromTarget(f'{names.HOST_CPU_BUSY}{{instance=~"$instance"}}', "{{host}} busiest CPU core"),
                   PromTarget(f'{names.HOST_GPU_BUSY}{{instance=~"$instance"}}', "{{host}} GPU"),
                   PromTarget(f'{names.HOST_MEMORY_USED}{{instance=~"$instance"}}',
                              "{{host}} fullest memory"),
                   unit="percentunit", w=24,
                   description="What the classification reads; GPU is 0 on hosts without GPUs."),
        table("Launch-bound modules",
              PromTarget(filtered(names.OP_LAUNCH_BOUND), instant=True, format="table"),
              w=24, h=6, unit="percentunit", exclude=("Time", "__name__", "job"),
              description=f"Ops whose kernels keep the GPU busy less than "
                          f"{PRODUCTION.thresholds.launch_bound_busy_ratio:.0%} of their region time "
                          "(Value: the busy share), from sampled CUPTI windows (gpuscope serve "
                          "--timing.kernel-busy): the GPU mostly waits for their launches; CUDA graphs or "
                          "fewer, larger kernels help."),
        stat("Host CPU busy", PromTarget(f"max({CPU_BUSY})"), unit="percentunit", w=6),
        stat("Host memory used", PromTarget(f"max({HOST_MEMORY})"), unit="percentunit", w=6),
        stat("GPU busy", PromTarget(f"avg({GPU_BUSY})"), unit="percentunit", w=6),
        stat("GPU memory used", PromTarget(f"max({GPU_MEMORY})"), unit="percentunit", w=6),
        timeseries("CPU against GPU utilization", PromTarget(CPU_BUSY, "{{instance}} host CPU"),
                   PromTarget(GPU_BUSY, "{{instance}} GPU"), unit="percentunit",
                   description="CPU high while GPUs idle: CPU-bound (tokenization, scheduling, Python)."),
        timeseries("Memory: host, GPU framebuffer, server", PromTarget(HOST_MEMORY, "{{instance}} host"),
                   PromTarget(GPU_MEMORY, "{{instance}} GPU framebuffer"), unit="percentunit"),
        timeseries("CPU by mode",
                   PromTarget('sum by (instance, mode) (rate(node_cpu_seconds_total{instance=~"$instance",'
                              'mode!="idle"}[$__rate_interval]))', "{{instance}} {{mode}}"),
                   unit="short", stack=True, description="CPU seconds per second (cores) by mode."),
        timeseries("Server memory held", PromTarget(filtered(names.DEVICE_MEMORY_ALLOCATED),
                                                    "{{instance}} {{device}} allocated"),
                   PromTarget(filtered(names.DEVICE_MEMORY_RESERVED), "{{instance}} {{device}} reserved"),
                   unit="bytes",
                   description="torch allocated/reserved bytes on CUDA; process resident memory on CPU."),
        timeseries("Load average and run queue",
                   PromTarget('node_load1{instance=~"$instance"}', "{{instance}} load1"),
                   PromTarget('node_procs_running{instance=~"$instance"}', "{{instance}} running")),
        timeseries("Queue depth against GPU utilization",
                   PromTarget(f"sum by (instance) ({filtered(names.QUEUE_DEPTH)})",
                              "{{instance}} waiting requests"),
                   PromTarget(GPU_BUSY, "{{instance}} GPU busy"),
                   description="Requests waiting while the GPU is not busy point at the CPU side."),
    ],
)
