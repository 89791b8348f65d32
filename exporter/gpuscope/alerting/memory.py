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

from gpuscope.alerting import names
from gpuscope.alerting.config import Profile
from gpuscope.alerting.rules import Alert, Doc, Group, duration, num, query_value
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


def headroom(used: str, total: str, peak_window: int, labels: tuple[str, ...], min_age: int = 0) -> str:
    """Bytes left: capacity minus the highest value over ``peak_window`` (where a sawtooth's next peak
    would hit capacity); with ``min_age``, only for series at least that old (a new process warms up)."""
    on = _on(labels)
    expr = f"clamp_min({total} - {on} max_over_time({used}[{duration(peak_window)}]), 0)"
    return f"{expr}\nand {on}\n{used} offset {duration(min_age)}" if min_age else expr


def _exhaustion(head: str, rate: str, labels: tuple[str, ...], horizon: int) -> str:
    """Time to exhaustion at the recorded growth, below ``horizon``."""
    return f"{head}\n/ {_on(labels)} ({rate} > 0)\n< {horizon}"


def kv_exhausted_condition(p: Profile) -> str:
    """KV cache full and requests preempted, on a server without a memory floor (vLLM)."""
    on = "on (job, instance)"
    return (f"{names.KV_CACHE_USAGE} >= {num(p.thresholds.kv_cache_full_ratio)}\nand {on}\n"
            f"sum by (job, instance) ({names.PREEMPTIONS_RATE}) > 0\nunless {on}\n{names.MEMORY_HEADROOM}")


def leak_condition(p: Profile) -> str:
    """The memory dimension of the composite: the leak alerts' conditions on the server's memory, or
    on a server without one (vLLM) its KV cache exhausted."""
    slow = _exhaustion(names.MEMORY_HEADROOM, names.MEMORY_GROWTH_RATE, SERVER_LABELS,
                       p.thresholds.leak_horizon_s)
    fast = _exhaustion(names.MEMORY_HEADROOM_FAST, names.MEMORY_GROWTH_RATE_FAST, SERVER_LABELS,
                       p.windows.leak_fast_horizon)
    return f"(\n{slow}\n)\nor\n(\n{fast}\n)\nor\n(\n{kv_exhausted_condition(p)}\n)"


def _query(expr: str, labels: tuple[str, ...], humanizer: str) -> str:
    return query_value(expr.replace("{}", "{" + ",".join(f"{label}='%s'" for label in labels) + "}"),
                       labels, humanizer)


def _holds(used: str, total: str, labels: tuple[str, ...], where: str) -> str:
    now = _query(used + "{}", labels, "humanize1024")
    cap = _query(total + "{}", labels, "humanize1024")
    return f"{where} holds {now}B of {cap}B"


def _slow_description(used: str, total: str, rate: str, labels: tuple[str, ...], where: str,
                      p: Profile) -> str:
    w = p.windows
    growth = _query(rate + "{}", labels, "humanize1024")
    span = w.leak - w.leak_floor
    return (f"{_holds(used, total, labels, where)}. Its floor (lowest value over {duration(w.leak_floor)}) "
            f"grew in every {duration(w.leak_step)} of the last {duration(span)}, in the last "
            f"{duration(span - w.leak_step)} by at least {growth}B/s; at that rate the memory runs out in "
            f"{{{{ $value | humanizeDuration }}}}.")


def _fast_description(used: str, total: str, rate: str, labels: tuple[str, ...], where: str,
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
    server_where = "The server {{ $labels.instance }} on {{ $labels.device }}"
    gpu_where = "GPU {{ $labels.gpu }} on {{ $labels.instance }}"
    srv = {"dashboard": uids.FLEET, "service": p.selectors.server_service}
    exp = {"dashboard": uids.FLEET, "service": p.selectors.exporter_service,
           "dashboard_vars": ("instance", "gpu")}
    server = (names.DEVICE_MEMORY_ALLOCATED, names.DEVICE_MEMORY_TOTAL, SERVER_LABELS, server_where)
    gpu = (names.GPU_MEMORY_USED, names.GPU_MEMORY_TOTAL, GPU_LABELS, gpu_where)

    def slow(target: tuple, head: str, rate: str) -> dict:
        return {"for_s": w.leak_for, "severity": "warning", "evidence_s": w.leak,
                "expr": _exhaustion(head, rate, target[2], t.leak_horizon_s),
                "description": _slow_description(target[0], target[1], rate, target[2], target[3], p)}

    def fast(target: tuple, head: str, rate: str) -> dict:
        return {"for_s": w.leak_fast_for, "severity": "critical",
                "evidence_s": w.leak_fast_floor + w.leak_fast_step,
                "expr": _exhaustion(head, rate, target[2], w.leak_fast_horizon),
                "description": _fast_description(target[0], target[1], rate, target[2], target[3], p)}

    alerts = [
        Alert(name="GPUMemoryLeak", **srv, **slow(server, names.MEMORY_HEADROOM, names.MEMORY_GROWTH_RATE),
              summary="Memory of {{ $labels.instance }} ({{ $labels.device }}) leaks towards exhaustion",
              doc=Doc(what="The server's memory floor keeps rising and will run out (one of the composite's "
                           "three dimensions)",
                      threshold=slow_threshold, window=slow_window, why=slow_why)),
        Alert(name="GPUMemoryRunningOut", **srv,
              **fast(server, names.MEMORY_HEADROOM_FAST, names.MEMORY_GROWTH_RATE_FAST),
              summary="Memory of {{ $labels.instance }} ({{ $labels.device }}) runs out within "
                      f"{fast_horizon}",
              doc=Doc(what="The server's memory grows fast enough to run out soon (composite dimension: "
                           "memory leak)",
                      threshold=f"runs out within {fast_horizon} at the recent growth",
                      window=fast_window, why=fast_why)),
        Alert(name="GPUFramebufferFillingUp", **exp,
              **slow(gpu, names.GPU_MEMORY_HEADROOM, names.GPU_MEMORY_GROWTH_RATE),
              summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} fills its memory",
              doc=Doc(what="A GPU's framebuffer floor (all processes) keeps rising and will run out",
                      threshold=slow_threshold, window=slow_window,
                      why=slow_why + " Catches processes other than the server.")),
        Alert(name="GPUFramebufferRunningOut", **exp,
              **fast(gpu, names.GPU_MEMORY_HEADROOM_FAST, names.GPU_MEMORY_GROWTH_RATE_FAST),
              summary=f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.instance }}}} runs out of memory within "
                      f"{fast_horizon}",
              doc=Doc(what="A GPU's framebuffer (all processes) grows fast enough to run out soon",
                      threshold=f"runs out within {fast_horizon} at the recent growth",
                      window=fast_window, why=fast_why)),
    ]
    alerts.append(Alert(
        name="GPUKVCacheExhausted", expr=kv_exhausted_condition(p), for_s=w.latency_for,
        evidence_s=w.latency, severity="warning", **srv,
        summary="KV cache of {{ $labels.instance }} is full and preempting requests",
        description=(f"The KV cache of {{{{ $labels.instance }}}} is {{{{ $value | humanizePercentage }}}} "
                     f"full and requests were preempted for lack of it over the last "
                     f"{duration(w.latency)}: each preempted request is recomputed later."),
        doc=Doc(what="KV cache full and requests preempted, on a server without a memory floor (vLLM): "
                     "the composite's memory dimension there",
                threshold=f"usage ≥ {num(t.kv_cache_full_ratio * 100)}% and preemptions > 0",
                window=f"preemptions over {duration(w.latency)}, for {duration(w.latency_for)}",
                why="vLLM preallocates its GPU memory, so it cannot leak into exhaustion the way a "
                    "growing process does; it runs out when the KV cache no longer holds the running "
                    "batch and preempts. A full cache alone is vLLM working as designed."),
    ))
    return [Group("gpuscope-memory", tuple(alerts))]
