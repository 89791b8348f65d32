"""Bottleneck classification per host, for the bottlenecks dashboard (recording rules only).

Joining node_exporter and GPU exporter series: both are keyed by ``host``. A scrape config may set a
``host`` label on its targets (compose must: its services have different host names); without one,
``host`` is the host part of ``instance`` (port stripped), which is right whenever both exporters
run on the machine they describe. Results carry ``host`` and the node_exporter's ``instance``.

Classes, exactly one per host, in this order: ``memory_pressure`` (host RAM or any GPU framebuffer
at least ``bottleneck_memory_ratio`` full), ``idle`` (busiest CPU core and GPU both below
``bottleneck_idle_ratio``), else the busier of the two: ``gpu_bound`` or ``cpu_bound``. CPU is the
busiest core, not the average: an inference server starved by one Python thread shows one core at
100% on an otherwise idle machine. Hosts without GPUs count as GPU utilization 0.

Per op, where the server measures kernel busy ratios (``--timing.kernel-busy``): ``op_launch_bound``
keeps the ops whose kernels keep the GPU busy less than ``launch_bound_busy_ratio`` of their region
time. A launch-bound op on a ``cpu_bound`` host says which modules to capture in CUDA graphs.
"""

from __future__ import annotations

from gpuscope.alerting.rules import Group, Record
from gpuscope.contract import names
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import duration, num, with_host

ON = "on (host, instance)"


def _attach(per_host: str) -> str:
    """A per-``host`` series given the node's ``instance`` (one-to-one with HOST_CPU_BUSY)."""
    return f"{per_host}\n+ on (host) group_right\n0 * {names.HOST_CPU_BUSY}"


def groups(p: Profile) -> list[Group]:
    s, t = p.selectors, p.thresholds
    w = duration(p.windows.bottleneck)
    idle_cpu = with_host(f'rate(node_cpu_seconds_total{{{s.node},mode="idle"@M}}[{w}])')
    gpu_util = with_host(f"{names.GPU_UTILIZATION}{{@M}}")
    fb = with_host(f"{names.GPU_MEMORY_USED}{{@M}} / {names.GPU_MEMORY_TOTAL}{{@M}}")
    ram = with_host(f"1 - node_memory_MemAvailable_bytes{{{s.node}@M}}"
                    f" / node_memory_MemTotal_bytes{{{s.node}@M}}")
    cpu, gpu, mem = names.HOST_CPU_BUSY, names.HOST_GPU_BUSY, names.HOST_MEMORY_USED
    ram_r, fb_r = names.HOST_RAM_USED, names.HOST_GPU_MEMORY_USED
    pressure = f"{mem} >= {num(t.bottleneck_memory_ratio)}"
    idle = f"{cpu} < {num(t.bottleneck_idle_ratio)} and {ON} {gpu} < {num(t.bottleneck_idle_ratio)}"
    klass = names.BOTTLENECK_CLASS
    records = [
        Record(cpu, f"max by (host, instance) (\n  1 - (\n{_indent(idle_cpu, 4)}\n  )\n)"),
        Record(gpu, f"(\n{_indent(_attach(f'max by (host) ({gpu_util})'), 2)}\n)\nor\n0 * {cpu}"),
        Record(ram_r, f"max by (host, instance) (\n{_indent(ram, 2)}\n)"),
        Record(fb_r, _attach(f"max by (host) (\n{_indent(fb, 2)}\n)")),
        Record(mem, f"{ram_r} >= {ON} {fb_r}\nor {ON}\n{fb_r}\nor\n{ram_r}"),
        Record(klass, f"group by (host, instance) ({pressure})", {"class": "memory_pressure"}),
        Record(klass, f"group by (host, instance) (\n  {idle}\n  unless {ON} ({pressure})\n)",
               {"class": "idle"}),
        Record(names.BOTTLENECK_CLASS,
               f"group by (host, instance) (\n  {gpu} >= {ON} {cpu}\n  unless {ON} ({pressure})\n"
               f"  unless {ON} ({idle})\n)", {"class": "gpu_bound"}),
        Record(names.BOTTLENECK_CLASS,
               f"group by (host, instance) (\n  {cpu} > {ON} {gpu}\n  unless {ON} ({pressure})\n"
               f"  unless {ON} ({idle})\n)", {"class": "cpu_bound"}),
        Record(names.OP_LAUNCH_BOUND, f"{names.REGION_GPU_BUSY_RATIO} < {num(t.launch_bound_busy_ratio)}"),
    ]
    return [Group("gpuscope-bottleneck", tuple(records))]


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())
