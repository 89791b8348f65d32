"""Memory leaks: sustained growth that a linear prediction says will exhaust memory within a horizon.

The server's own memory (``gpuscope_device_memory_allocated_bytes``: torch allocated bytes on CUDA,
resident memory on CPU) against its capacity (``gpuscope_device_memory_total_bytes``), so a leak is
provable on a machine without a GPU. Three conditions, each for a trap:

- ``predict_linear`` over ``leak`` reaches capacity within the horizon: a flat allocate/free
  sawtooth has no trend, so its prediction stays near its mean;
- ``deriv`` over the short ``leak_growth`` window is still positive: a warm-up ramp that has
  plateaued fails this ``leak_growth`` after the plateau starts;
- ``for: leak_for``, longer than a warm-up ramp plus ``leak_growth``: a ramp does not last long enough.

The same test runs on the exporter's framebuffer numbers per GPU, which also catches other
processes filling the GPU.
"""

from __future__ import annotations

from gpuscope import catalogue as m
from gpuscope.alerting.config import Profile
from gpuscope.alerting.rules import Alert, Doc, Group, duration, query_value, sel

SERVER_LABELS = ("job", "instance", "device")
GPU_LABELS = ("job", "instance", "gpu")


def _condition(used: str, total: str, labels: tuple[str, ...], p: Profile) -> str:
    w, on = p.windows, ", ".join(labels)
    return (f"predict_linear({used}[{duration(w.leak)}], {p.thresholds.leak_horizon_s})\n"
            f"  > on ({on}) {total}\n"
            f"and on ({on})\n"
            f"deriv({used}[{duration(w.leak_growth)}]) > 0")


def leak_condition(p: Profile) -> str:
    """The memory-leak dimension of the composite (server memory, per instance and device)."""
    s = p.selectors.server
    return _condition(sel(m.DEVICE_MEMORY_ALLOCATED.name, s), sel(m.DEVICE_MEMORY_TOTAL.name, s),
                      SERVER_LABELS, p)


def _description(used: m.Metric, total: m.Metric, labels: tuple[str, ...], where: str, p: Profile) -> str:
    match = ",".join(f"{label}='%s'" for label in labels)
    now = query_value(f"{used.name}{{{match}}}", labels, "humanize1024")
    cap = query_value(f"{total.name}{{{match}}}", labels, "humanize1024")
    rate = query_value(f"deriv({used.name}{{{match}}}[{duration(p.windows.leak)}])", labels, "humanize1024")
    horizon = duration(p.thresholds.leak_horizon_s)
    return (f"{where} holds {now}B of {cap}B and has grown at {rate}B/s over the last "
            f"{duration(p.windows.leak)}; at that rate it reaches {{{{ $value | humanize1024 }}}}B "
            f"in {horizon}, more than its capacity.")


def groups(p: Profile) -> list[Group]:
    w = p.windows
    horizon = duration(p.thresholds.leak_horizon_s)
    window = (f"trend over {duration(w.leak)}, still growing over {duration(w.leak_growth)}, "
              f"for {duration(w.leak_for)}")
    why = ("Warm-up ramps plateau (growth stops), allocate/free sawtooths have no trend; only "
           "growth that lasts and points past capacity fires.")
    e = p.selectors.exporter
    alerts = [
        Alert(
            name="GPUMemoryLeak", expr=leak_condition(p), for_s=w.leak_for, severity="warning",
            evidence_s=w.leak,
            service=p.selectors.server_service, dashboard="gpuscope-fleet",
            summary="Memory of {{ $labels.instance }} ({{ $labels.device }}) grows towards exhaustion",
            description=_description(m.DEVICE_MEMORY_ALLOCATED, m.DEVICE_MEMORY_TOTAL, SERVER_LABELS,
                                     "The server {{ $labels.instance }} on {{ $labels.device }}", p),
            doc=Doc(what="The server's memory grows steadily and will run out (one of the composite's "
                         "three dimensions)",
                    threshold=f"linear prediction reaches capacity within {horizon}", window=window,
                    why=why)),
        Alert(
            name="GPUFramebufferFillingUp",
            expr=_condition(sel(m.GPU_MEMORY_USED.name, e), sel(m.GPU_MEMORY_TOTAL.name, e), GPU_LABELS, p),
            for_s=w.leak_for, severity="warning", service=p.selectors.exporter_service,
            dashboard="gpuscope-fleet",
            summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} fills its memory",
            description=_description(m.GPU_MEMORY_USED, m.GPU_MEMORY_TOTAL, GPU_LABELS,
                                     "GPU {{ $labels.gpu }} on {{ $labels.instance }}", p),
            doc=Doc(what="A GPU's framebuffer (all processes, from NVML) grows steadily and will run out",
                    threshold=f"linear prediction reaches total memory within {horizon}", window=window,
                    why=why + " Catches processes other than the server."))
    ]
    return [Group("gpuscope-memory", tuple(alerts))]
