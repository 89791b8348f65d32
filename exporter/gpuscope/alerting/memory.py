"""Memory leaks: growth of the memory *floor* that lasts, against shapes that healthy servers make.

The server's own memory (``gpuscope_device_memory_allocated_bytes``: torch allocated bytes on CUDA,
resident memory on CPU) against its capacity (``gpuscope_device_memory_total_bytes``), so a leak is
provable on a machine without a GPU; the same rules run on the exporter's framebuffer per GPU, which
also catches other processes filling a GPU.

Why not ``predict_linear`` over an hour with "still growing" over five minutes (the first version):
a leak that grows in steps, allocate/free cycles whose floor rises, or ±1% allocation noise all have
flat or falling five-minute windows, which reset ``for`` forever; and for an hour after a warm-up the
regression still holds the ramp, so a server that reached its working set fires. Leaks and healthy
shapes differ in the *floor* (the lowest value over ``leak_floor``): requests allocate and free on
top of it, noise and sawtooth peaks leave it, and only memory that is never given back raises it.

``GPUMemoryLeak`` (warning), every condition for a shape it must not fire on:

- the floor grew across *every* ``leak_step``-long interval of the last ``leak − leak_floor``
  (checked every ``leak_resolution`` by a subquery): a sawtooth's free, a plateau, or a ramp that
  stopped make some interval flat or falling. A healthy ramp (a warm-up, the allocate phase of a
  slow cycle) must last longer than ``leak`` to pass; ``leak_step`` must be at least the period of a
  leak that grows in steps, so that every interval holds a step;
- the series has ``leak + leak_step`` of history, so a ramp from a new process's first sample is not
  judged on a partial window;
- the latest interval's growth is at least ``leak_min_growth_ratio`` of the first one's: a cache that
  fills up towards a ceiling (the tail of a warm-up, a creep towards 95%) grows ever slower, and an
  interval that still holds the warm-up ramp grows far faster than the creep after it;
- at the *slowest* growth of any interval (leaving out the span's first ``leak_step``, whose first
  interval straddles the start of a leak that has only just filled the span), memory runs out within
  ``leak_horizon_s``, counted from the highest value over ``leak_floor`` (where a sawtooth's next
  peak would hit capacity). The slowest interval, not a regression over the span, so a ramp inside
  the span cannot speed it up.
  The alert's value is that time to exhaustion, which the annotation prints (never a projection of
  bytes far past capacity).

``GPUMemoryRunningOut`` (critical) catches leaks faster than that evidence: the floor over
``leak_fast_floor`` grew over ``leak_fast_step`` at a rate that exhausts memory within
``leak_fast_horizon``, for ``leak_fast_for`` (shorter than the exhaustion times it exists for). A
warm-up has the same shape, and a new process warms up: the series must be ``leak_fast_min_age``
old. A climb that would exhaust memory this fast for longer than ``leak_fast_for`` fires whatever
its cause; a traffic surge that lifts memory for a few minutes and levels off does not.
"""

from __future__ import annotations

from gpuscope import catalogue as m
from gpuscope.alerting import names
from gpuscope.alerting.config import Profile
from gpuscope.alerting.rules import Alert, Doc, Group, Record, duration, num, query_value, sel
from gpuscope.dashboards import uids

SERVER_LABELS = ("job", "instance", "device")
GPU_LABELS = ("job", "instance", "gpu")


def _on(labels: tuple[str, ...]) -> str:
    return f"on ({', '.join(labels)})"


def _growth(used: str, floor: int, step: int, offset: int = 0) -> str:
    """Growth of the floor (min over ``floor``) over ``step``, ending ``offset`` seconds ago."""
    at = f" offset {duration(offset)}" if offset else ""
    return (f"min_over_time({used}[{duration(floor)}]{at}) - "
            f"min_over_time({used}[{duration(floor)}] offset {duration(offset + step)})")


def growth_rate_record(used: str, labels: tuple[str, ...], p: Profile) -> str:
    """Slowest floor growth (bytes/s), present while the floor grew across every interval of the span
    (with the history and fading guards). The rate leaves out the span's first ``leak_step``: when the
    check first passes, the first interval still straddles the leak's start and would read it low."""
    w, t, on = p.windows, p.thresholds, _on(labels)
    span, res = w.leak - w.leak_floor, duration(w.leak_resolution)
    growth = _growth(used, w.leak_floor, w.leak_step)
    return (f"min_over_time((\n  {growth}\n)[{duration(span - w.leak_step)}:{res}]) / {w.leak_step}\n"
            f"and {on}\n"
            f"min_over_time((\n  {growth}\n)[{duration(span)}:{res}]) > 0\n"
            f"and {on}\n"
            f"{growth}\n"
            f"  >= {num(t.leak_min_growth_ratio)} * ({_growth(used, w.leak_floor, w.leak_step, span)})\n"
            f"and {on}\n"
            f"{used} offset {duration(w.leak + w.leak_step)}")


def fast_rate_record(used: str, p: Profile) -> str:
    """Floor growth (bytes/s) over the last few minutes."""
    w = p.windows
    return f"({_growth(used, w.leak_fast_floor, w.leak_fast_step)}) / {w.leak_fast_step}"


def _time_to_exhaustion(used: str, total: str, rate: str, peak_window: int, labels: tuple[str, ...]) -> str:
    on = _on(labels)
    return (f"clamp_min({total} - {on} max_over_time({used}[{duration(peak_window)}]), 0)\n"
            f"/ {on} ({rate} > 0)")


def _slow(used: str, total: str, rate: str, labels: tuple[str, ...], p: Profile) -> str:
    return (f"{_time_to_exhaustion(used, total, rate, p.windows.leak_floor, labels)}\n"
            f"< {p.thresholds.leak_horizon_s}")


def _fast(used: str, total: str, rate: str, labels: tuple[str, ...], p: Profile) -> str:
    w = p.windows
    return (f"{_time_to_exhaustion(used, total, rate, w.leak_fast_floor, labels)}\n"
            f"< {p.windows.leak_fast_horizon}\n"
            f"and {_on(labels)}\n"
            f"{used} offset {duration(w.leak_fast_min_age)}")


def _server(p: Profile) -> tuple[str, str]:
    s = p.selectors.server
    return sel(m.DEVICE_MEMORY_ALLOCATED.name, s), sel(m.DEVICE_MEMORY_TOTAL.name, s)


def _gpu(p: Profile) -> tuple[str, str]:
    e = p.selectors.exporter
    return sel(m.GPU_MEMORY_USED.name, e), sel(m.GPU_MEMORY_TOTAL.name, e)


def leak_condition(p: Profile) -> str:
    """The memory-leak dimension of the composite: either alert's condition on the server's memory."""
    used, total = _server(p)
    return (f"(\n{_slow(used, total, names.MEMORY_GROWTH_RATE, SERVER_LABELS, p)}\n)\nor\n"
            f"(\n{_fast(used, total, names.MEMORY_GROWTH_RATE_FAST, SERVER_LABELS, p)}\n)")


def _query(expr: str, labels: tuple[str, ...], humanizer: str) -> str:
    return query_value(expr.replace("{}", "{" + ",".join(f"{label}='%s'" for label in labels) + "}"),
                       labels, humanizer)


def _holds(used: m.Metric, total: m.Metric, labels: tuple[str, ...], where: str) -> str:
    now = _query(used.name + "{}", labels, "humanize1024")
    cap = _query(total.name + "{}", labels, "humanize1024")
    return f"{where} holds {now}B of {cap}B"


def _slow_description(used: m.Metric, total: m.Metric, rate: str, labels: tuple[str, ...], where: str,
                      p: Profile) -> str:
    w = p.windows
    growth = _query(rate + "{}", labels, "humanize1024")
    span = w.leak - w.leak_floor
    return (f"{_holds(used, total, labels, where)}. Its floor (lowest value over {duration(w.leak_floor)}) "
            f"grew in every {duration(w.leak_step)} of the last {duration(span)}, in the last "
            f"{duration(span - w.leak_step)} by at least {growth}B/s; at that rate the memory runs out in "
            f"{{{{ $value | humanizeDuration }}}}.")


def _fast_description(used: m.Metric, total: m.Metric, rate: str, labels: tuple[str, ...], where: str,
                      p: Profile) -> str:
    w = p.windows
    growth = _query(rate + "{}", labels, "humanize1024")
    return (f"{_holds(used, total, labels, where)} and grew {growth}B/s over the last "
            f"{duration(w.leak_fast_step)}; at that rate the memory runs out in "
            f"{{{{ $value | humanizeDuration }}}}.")


def groups(p: Profile) -> list[Group]:
    w, t = p.windows, p.thresholds
    horizon, fast_horizon = duration(t.leak_horizon_s), duration(w.leak_fast_horizon)
    span = duration(w.leak - w.leak_floor)
    slow_window = (f"floor = min over {duration(w.leak_floor)}; grown in every {duration(w.leak_step)} "
                   f"of the last {span}; for {duration(w.leak_for)}")
    slow_threshold = (f"runs out within {horizon} at the slowest interval's growth; latest growth ≥ "
                      f"{num(t.leak_min_growth_ratio)}× the first's")
    slow_why = ("Leaks raise the floor; allocate/free cycles, noise, warm-up ramps, plateaus and caches "
                "filling up towards a ceiling do not keep raising it. Fires on steps, rising-floor "
                "cycles and noisy leaks that a five-minute derivative misses.")
    fast_window = (f"floor = min over {duration(w.leak_fast_floor)}, growth over "
                   f"{duration(w.leak_fast_step)}; for {duration(w.leak_fast_for)}; series "
                   f"≥ {duration(w.leak_fast_min_age)} old")
    fast_why = (f"The slow rule needs {duration(w.leak)} of evidence; a leak that exhausts memory "
                f"sooner pages while there is time to act. A climb this fast that lasts longer than "
                f"{duration(w.leak_fast_for)} pages whatever its cause; a new process's warm-up does not.")
    s_used, s_total = _server(p)
    g_used, g_total = _gpu(p)
    server_where = "The server {{ $labels.instance }} on {{ $labels.device }}"
    gpu_where = "GPU {{ $labels.gpu }} on {{ $labels.instance }}"
    common = {"dashboard": uids.FLEET}
    srv = {**common, "service": p.selectors.server_service}
    exp = {**common, "service": p.selectors.exporter_service}
    records = [
        Record(names.MEMORY_GROWTH_RATE, growth_rate_record(s_used, SERVER_LABELS, p)),
        Record(names.MEMORY_GROWTH_RATE_FAST, fast_rate_record(s_used, p)),
        Record(names.GPU_MEMORY_GROWTH_RATE, growth_rate_record(g_used, GPU_LABELS, p)),
        Record(names.GPU_MEMORY_GROWTH_RATE_FAST, fast_rate_record(g_used, p)),
    ]
    alerts = [
        Alert(
            name="GPUMemoryLeak", for_s=w.leak_for, severity="warning", evidence_s=w.leak, **srv,
            expr=_slow(s_used, s_total, names.MEMORY_GROWTH_RATE, SERVER_LABELS, p),
            summary="Memory of {{ $labels.instance }} ({{ $labels.device }}) leaks towards exhaustion",
            description=_slow_description(m.DEVICE_MEMORY_ALLOCATED, m.DEVICE_MEMORY_TOTAL,
                                          names.MEMORY_GROWTH_RATE, SERVER_LABELS, server_where, p),
            doc=Doc(what="The server's memory floor keeps rising and will run out (one of the composite's "
                         "three dimensions)",
                    threshold=slow_threshold, window=slow_window, why=slow_why)),
        Alert(
            name="GPUMemoryRunningOut", for_s=w.leak_fast_for, severity="critical",
            evidence_s=w.leak_fast_floor + w.leak_fast_step, **srv,
            expr=_fast(s_used, s_total, names.MEMORY_GROWTH_RATE_FAST, SERVER_LABELS, p),
            summary="Memory of {{ $labels.instance }} ({{ $labels.device }}) runs out within "
                    f"{fast_horizon}",
            description=_fast_description(m.DEVICE_MEMORY_ALLOCATED, m.DEVICE_MEMORY_TOTAL,
                                          names.MEMORY_GROWTH_RATE_FAST, SERVER_LABELS, server_where, p),
            doc=Doc(what="The server's memory grows fast enough to run out soon (composite dimension: "
                         "memory leak)",
                    threshold=f"runs out within {fast_horizon} at the recent growth",
                    window=fast_window, why=fast_why)),
        Alert(
            name="GPUFramebufferFillingUp", for_s=w.leak_for, severity="warning", evidence_s=w.leak,
            dashboard_vars=("instance", "gpu"), **exp,
            expr=_slow(g_used, g_total, names.GPU_MEMORY_GROWTH_RATE, GPU_LABELS, p),
            summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} fills its memory",
            description=_slow_description(m.GPU_MEMORY_USED, m.GPU_MEMORY_TOTAL,
                                          names.GPU_MEMORY_GROWTH_RATE, GPU_LABELS, gpu_where, p),
            doc=Doc(what="A GPU's framebuffer floor (all processes, from NVML) keeps rising and will run out",
                    threshold=slow_threshold, window=slow_window,
                    why=slow_why + " Catches processes other than the server.")),
        Alert(
            name="GPUFramebufferRunningOut", for_s=w.leak_fast_for, severity="critical",
            evidence_s=w.leak_fast_floor + w.leak_fast_step, dashboard_vars=("instance", "gpu"), **exp,
            expr=_fast(g_used, g_total, names.GPU_MEMORY_GROWTH_RATE_FAST, GPU_LABELS, p),
            summary=f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.instance }}}} runs out of memory within "
                    f"{fast_horizon}",
            description=_fast_description(m.GPU_MEMORY_USED, m.GPU_MEMORY_TOTAL,
                                          names.GPU_MEMORY_GROWTH_RATE_FAST, GPU_LABELS, gpu_where, p),
            doc=Doc(what="A GPU's framebuffer (all processes) grows fast enough to run out soon",
                    threshold=f"runs out within {fast_horizon} at the recent growth",
                    window=fast_window, why=fast_why)),
    ]
    return [Group("gpuscope-memory", (*records, *alerts))]
