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

``GPUMemoryRunningOut`` (critical) catches leaks faster than that evidence, in two rules of one name
told apart by their ``trigger`` label:

- ``sustained``: the floor over ``leak_fast_floor`` grew over ``leak_fast_step`` at a rate that
  exhausts memory within ``leak_fast_horizon``, for ``leak_fast_for`` (shorter than the exhaustion
  times it exists for; longer than a traffic surge's climb), and only where two healthy shapes are
  ruled out:

  - a *warm-up*: the process has run ``leak_fast_min_age`` since its last start. A restart keeps the
    series and its labels, so the series' age alone does not tell; a new process starts with next
    to nothing allocated, so memory falling below ``leak_restart_ratio`` of its peak within that
    time counts as a start too (a cache flushed to almost nothing is treated the same). The server
    here has no ``process_start_time_seconds`` (its registry is its own), and a GPU's framebuffer
    outlives the processes on it, so the memory series itself is the one signal both roles have;
  - *allocate/free cycles*: the climb must top every peak of the ``leak_fast_history`` before the
    last ``leak_fast_for`` by ``leak_new_high_ratio`` of capacity. A leak makes new highs; a cache
    that is flushed climbs back to the same peak, however fast, and a restarted server warms up to
    the working set it had (the history spans the restart). A series younger than ``leak_fast_for``
    has no earlier peak: its climb is new (the warm-up guard holds it).

- ``near_full``: at any age, memory is at least ``leak_near_full_ratio`` of capacity, tops every
  earlier peak as above, and grew since the last evaluation at a rate that exhausts it within
  ``leak_near_full_horizon``, for ``leak_near_full_for``. A warm-up plateaus, so its growth stops
  within an evaluation of its plateau; a leak from the process's first minute keeps climbing
  through 90%, which the warm-up guard would otherwise hide for its whole life. It pages late by
  nature (a leak that exhausts memory in 30 minutes, with about a minute left): its page means
  "out of memory now". A cache that cycles up to 95% returns to its earlier peak and stays silent.
  The growth is the slope between the last two records of the normalised series, so the source
  must be sampled at least once per evaluation interval (a slower one reads as flat half the time).

The tenants of ``gpuscope share`` (processes on one GPU, each tenant's memory capped) have two alerts
of their own, on the memory their processes hold together against the cap:

- ``GPUTenantNearMemoryCap`` (warning): at least ``bottleneck_memory_ratio`` of the cap (the
  memory-pressure threshold of the bottleneck classes) for ``memory_cap_for``: the next allocations
  past the cap will be refused.
- ``GPUTenantAllocationsRefused`` (warning): allocations were refused at the cap within the
  ``latency`` window, so the tenant's processes got CUDA out-of-memory errors. Its own alert, not a
  case of the first: a single large allocation is refused at any fill level, and a refusal says the
  workload fails now where the fill level says it soon may; its description gives the fill level
  too. Warnings, not pages: the cap is the tenant's policy working, and a critical alert would
  inhibit every warning of the controller's instance, the other tenants' included.
"""

from __future__ import annotations

from gpuscope.alerting import operator_labels
from gpuscope.alerting.rules import Alert, Doc, Group, query_value
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Profile, Thresholds
from gpuscope.util.promql import duration, num

SERVER_LABELS = ("job", "instance", "device")
GPU_LABELS = ("job", "instance", "gpu")
#: A tenant of gpuscope share: its memory and cap are per controller (one GPU) and tenant.
TENANT_LABELS = ("job", "instance", "tenant")
NEAR_CAP = "GPUTenantNearMemoryCap"
REFUSED = "GPUTenantAllocationsRefused"


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


def headroom(used: str, total: str, peak_window: int, labels: tuple[str, ...], min_age: int = 0,
             restart_ratio: float = 0.0, start_time: str = "") -> str:
    """Bytes left: capacity minus the highest value over ``peak_window`` (where a sawtooth's next peak
    would hit capacity); with ``min_age``, only for a process settled that long: the series is that
    old and has not fallen below ``restart_ratio`` of its peak within it (a restart keeps the labels
    and starts from next to nothing; leak_restart_ratio where the caller gives none), and, where the
    scrape has one (``start_time``: the process' ``process_start_time_seconds``), its start time did
    not change within it (a restart that loads its working set within a scrape never falls)."""
    on = _on(labels)
    expr = f"clamp_min({total} - {on} max_over_time({used}[{duration(peak_window)}]), 0)"
    if not min_age:
        return expr
    ratio = restart_ratio or Thresholds().leak_restart_ratio
    age = duration(min_age)
    expr = (f"{expr}\nand {on}\n{used} offset {age}\nand {on}\n"
            f"min_over_time({used}[{age}]) >= {num(ratio)} * max_over_time({used}[{age}])")
    if start_time:
        expr += f"\nunless on (job, instance)\nchanges({start_time}[{age}]) > 0"
    return expr


def new_high(used: str, total: str, labels: tuple[str, ...], p: Profile) -> str:
    """Memory over the last ``leak_fast_floor`` tops every peak of the ``leak_fast_history`` before the
    last ``leak_fast_for`` by ``leak_new_high_ratio`` of capacity; or the series has no such history."""
    w, on = p.windows, _on(labels)
    before = f"max_over_time({used}[{duration(w.leak_fast_history)}] offset {duration(w.leak_fast_for)})"
    return (f"(\n  max_over_time({used}[{duration(w.leak_fast_floor)}])\n  > {on}\n"
            f"  ({before} + {on} {num(p.thresholds.leak_new_high_ratio)} * {total})\n"
            f"  or\n  {used} unless {on} {before}\n)")


def near_full_window(p: Profile) -> int:
    """Seconds of the range whose slope is the growth since the last evaluation (1.5 intervals)."""
    return p.evaluation_interval * 3 // 2


def near_full_condition(used: str, total: str, labels: tuple[str, ...], p: Profile) -> str:
    """Seconds to exhaustion at the growth since the last evaluation, where memory is near full and at
    a new high, below ``leak_near_full_horizon``."""
    w, on = p.windows, _on(labels)
    # The normalised series is recorded once per evaluation: a window of 1.5 intervals holds the last
    # two records whether the range's start is inclusive (Prometheus 2) or not (Prometheus 3).
    growth = f"deriv({used}[{duration(near_full_window(p))}])"
    return (f"({total} - {on} {used})\n/ {on}\n({growth} > 0)\n< {w.leak_near_full_horizon}\n"
            f"and {on}\n{used} >= {on} {num(p.thresholds.leak_near_full_ratio)} * {total}\n"
            f"and {on}\n{new_high(used, total, labels, p)}")


def climb_rate(used: str, p: Profile) -> str:
    """Slowest floor growth (bytes/s) over the ``leak_climb_step`` intervals of the last ``leak_climb``."""
    w = p.windows
    growth = _growth(used, w.leak_fast_floor, w.leak_climb_step)
    return (f"min_over_time((\n  {growth}\n)[{duration(w.leak_climb - w.leak_climb_step)}:"
            f"{duration(w.leak_resolution)}]) / {w.leak_climb_step}")


def climbing_condition(used: str, total: str, labels: tuple[str, ...], p: Profile) -> str:
    """Seconds to exhaustion at the slowest growth of a climb that lasted ``leak_climb`` at a leak's
    pace (neither a load's nor an allocate phase's), below ``leak_climb_horizon``, at a new high."""
    w, on = p.windows, _on(labels)
    rate = climb_rate(used, p)
    head = f"clamp_min({total} - {on} max_over_time({used}[{duration(w.leak_fast_floor)}]), 0)"
    return (f"{head}\n/ {on}\n(\n{rate}\n> 0)\n< {w.leak_climb_horizon}\n"
            f"and {on}\n({total} / {on} (\n{rate}\n)) >= {w.leak_climb_fill_fastest} "
            f"<= {w.leak_climb_fill_slowest}\n"
            f"and {on}\n{used} offset {duration(w.leak_climb)}\n"
            f"and {on}\n{new_high(used, total, labels, p)}")


def _exhaustion(head: str, rate: str, labels: tuple[str, ...], horizon: int) -> str:
    """Time to exhaustion at the recorded growth, below ``horizon``."""
    return f"{head}\n/ {_on(labels)} ({rate} > 0)\n< {horizon}"


def kv_exhausted_condition(p: Profile) -> str:
    """KV cache full and requests preempted, on a server without a memory floor (vLLM)."""
    on = "on (job, instance)"
    return (f"{names.KV_CACHE_USAGE} >= {num(p.thresholds.kv_cache_full_ratio)}\nand {on}\n"
            f"sum by (job, instance) ({names.PREEMPTIONS_RATE}) > 0\nunless {on}\n{names.MEMORY_HEADROOM}")


def sustained_condition(used: str, total: str, head: str, rate: str, labels: tuple[str, ...],
                        p: Profile) -> str:
    """Seconds to exhaustion at the recent floor growth, below ``leak_fast_horizon``, where the climb
    makes a new high (``head`` is only recorded for a settled process)."""
    fast = _exhaustion(head, rate, labels, p.windows.leak_fast_horizon)
    return f"{fast}\nand {_on(labels)}\n{new_high(used, total, labels, p)}"


def leak_condition(p: Profile) -> str:
    """The memory dimension of the composite: the leak alerts' conditions on the server's memory, or
    on a server without one (vLLM) its KV cache exhausted."""
    used, total = names.DEVICE_MEMORY_ALLOCATED, names.DEVICE_MEMORY_TOTAL
    slow = _exhaustion(names.MEMORY_HEADROOM, names.MEMORY_GROWTH_RATE, SERVER_LABELS,
                       p.thresholds.leak_horizon_s)
    fast = sustained_condition(used, total, names.MEMORY_HEADROOM_FAST, names.MEMORY_GROWTH_RATE_FAST,
                               SERVER_LABELS, p)
    near_full = near_full_condition(used, total, SERVER_LABELS, p)
    climbing = climbing_condition(used, total, SERVER_LABELS, p)
    return (f"(\n{slow}\n)\nor\n(\n{fast}\n)\nor\n(\n{near_full}\n)\nor\n(\n{climbing}\n)\n"
            f"or\n(\n{kv_exhausted_condition(p)}\n)")


def near_cap_condition(p: Profile) -> str:
    """The share of its memory cap a tenant holds, where at least the memory-pressure threshold."""
    on = _on(TENANT_LABELS)
    return (f"{names.TENANT_MEMORY_USED}\n/ {on}\n{names.TENANT_MEMORY_CAP}\n"
            f">= {num(p.thresholds.bottleneck_memory_ratio)}")


def refused_condition(p: Profile) -> str:
    """Allocations refused at a tenant's cap over the ``latency`` window, where any."""
    return f"round({names.TENANT_MEMORY_REFUSED_RATE} * {p.windows.latency}) > 0"


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
    return (f"{_holds(used, total, labels, where)}, above every peak of the {duration(w.leak_fast_history)} "
            f"before, and grew {growth}B/s over the last {duration(w.leak_fast_step)}; at that rate the "
            f"memory runs out in {{{{ $value | humanizeDuration }}}}.")


def _near_full_description(used: str, total: str, labels: tuple[str, ...], where: str, p: Profile) -> str:
    return (f"{_holds(used, total, labels, where)} (at least "
            f"{num(p.thresholds.leak_near_full_ratio * 100)}%, above every earlier peak) and is still "
            f"climbing: at its growth since the last evaluation the memory runs out "
            f"in {{{{ $value | humanizeDuration }}}}.")


def _climbing_description(used: str, total: str, labels: tuple[str, ...], where: str, p: Profile) -> str:
    w = p.windows
    return (f"{_holds(used, total, labels, where)}, above every earlier peak, and its floor grew in every "
            f"{duration(w.leak_climb_step)} of the last {duration(w.leak_climb)} at the pace of a leak, not "
            f"of a load: at its slowest growth the memory runs out in {{{{ $value | humanizeDuration }}}}.")


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
                   f"{duration(w.leak_fast_step)}; for {duration(w.leak_fast_for)}; process running "
                   f"≥ {duration(w.leak_fast_min_age)} since its last start; above the peaks of "
                   f"{duration(w.leak_fast_history)}")
    fast_threshold = (f"runs out within {fast_horizon} at the recent growth, ≥ "
                      f"{num(t.leak_new_high_ratio * 100)}% of capacity above every earlier peak")
    fast_why = (f"The slow rule needs {duration(w.leak)} of evidence; a leak that exhausts memory "
                f"sooner pages while there is time to act. A warm-up (after every restart: memory "
                f"below {num(t.leak_restart_ratio * 100)}% of its peak starts the guard again) and "
                f"allocate/free cycles that climb back to the same peak do not.")
    near_full_window = (f"growth since the last evaluation ({p.evaluation_interval}s); for "
                        f"{duration(w.leak_near_full_for)}; any age")
    near_full_threshold = (f"≥ {num(t.leak_near_full_ratio * 100)}% of capacity, above every earlier "
                           f"peak, runs out within {duration(w.leak_near_full_horizon)}")
    near_full_why = ("A leak from the process's first minute looks like a warm-up until the warm-up "
                     "guard ends; a warm-up plateaus, so memory this full and still climbing this fast "
                     "pages at any age.")
    climbing_window = (f"floor = min over {duration(w.leak_fast_floor)}; grown in every "
                       f"{duration(w.leak_climb_step)} of the last {duration(w.leak_climb)}; for "
                       f"{duration(w.leak_climb_for)}; any age")
    climbing_threshold = (f"runs out within {duration(w.leak_climb_horizon)} at the slowest interval's "
                          f"growth, a pace that fills the device from empty in "
                          f"{duration(w.leak_climb_fill_fastest)} to {duration(w.leak_climb_fill_slowest)}; "
                          f"above every earlier peak")
    climbing_why = (f"A leak that starts with its process looks like a warm-up to the sustained rule "
                    f"for {duration(w.leak_fast_min_age)}, and reaches "
                    f"{num(t.leak_near_full_ratio * 100)}% too late to act. Loads (weights, caches) "
                    f"climb faster and stop within minutes; allocate phases climb slower; neither keeps "
                    f"climbing for {duration(w.leak_climb)}.")
    server_where = "The server {{ $labels.instance }} on {{ $labels.device }}"
    gpu_where = "GPU {{ $labels.gpu }} on {{ $labels.instance }}" + operator_labels.WORKLOAD
    srv = {"dashboard": uids.FLEET, "service": p.selectors.server_service}
    exp = {"dashboard": uids.FLEET, "service": p.selectors.exporter_service,
           "dashboard_vars": ("instance", "gpu")}
    server = (names.DEVICE_MEMORY_ALLOCATED, names.DEVICE_MEMORY_TOTAL, SERVER_LABELS, server_where)
    gpu = (names.GPU_MEMORY_USED, names.GPU_MEMORY_TOTAL, GPU_LABELS, gpu_where)

    def labelled(target: tuple, expr: str) -> str:
        # A GPU's alert names the board and the workload on it; the server's already has its instance.
        return operator_labels.joined(expr) if target is gpu else expr

    def slow(target: tuple, head: str, rate: str) -> dict:
        return {"for_s": w.leak_for, "severity": "warning", "evidence_s": w.leak,
                "expr": labelled(target, _exhaustion(head, rate, target[2], t.leak_horizon_s)),
                "description": _slow_description(target[0], target[1], rate, target[2], target[3], p)}

    def fast(target: tuple, head: str, rate: str) -> dict:
        return {"for_s": w.leak_fast_for, "severity": "critical", "labels": {"trigger": "sustained"},
                "evidence_s": w.leak_fast_floor + w.leak_fast_step,
                "expr": labelled(target, sustained_condition(target[0], target[1], head, rate, target[2], p)),
                "description": _fast_description(target[0], target[1], rate, target[2], target[3], p)}

    def near_full(target: tuple) -> dict:
        return {"for_s": w.leak_near_full_for, "severity": "critical", "labels": {"trigger": "near_full"},
                "evidence_s": p.evaluation_interval,
                "expr": labelled(target, near_full_condition(target[0], target[1], target[2], p)),
                "description": _near_full_description(target[0], target[1], target[2], target[3], p)}

    def climbing(target: tuple) -> dict:
        return {"for_s": w.leak_climb_for, "severity": "critical", "labels": {"trigger": "climbing"},
                "evidence_s": w.leak_climb,
                "expr": labelled(target, climbing_condition(target[0], target[1], target[2], p)),
                "description": _climbing_description(target[0], target[1], target[2], target[3], p)}

    def running_out(name: str, route: dict, target: tuple, head: str, rate: str, summary: str,
                    what: str) -> list[Alert]:
        # The three triggers of one memory's running-out alert (sustained, near full, climbing): the
        # server's and a GPU's differ only in their names, series and words.
        return [
            Alert(name=name, **route, **fast(target, head, rate), summary=summary + fast_horizon,
                  doc=Doc(what=what, threshold=fast_threshold, window=fast_window, why=fast_why)),
            Alert(name=name, **route, **near_full(target),
                  summary=summary + duration(w.leak_near_full_horizon),
                  doc=Doc(what=what + ", near full at any age", threshold=near_full_threshold,
                          window=near_full_window, why=near_full_why)),
            Alert(name=name, **route, **climbing(target),
                  summary=summary + duration(w.leak_climb_horizon),
                  doc=Doc(what=what + ", climbing steadily at any age", threshold=climbing_threshold,
                          window=climbing_window, why=climbing_why)),
        ]

    alerts = [
        Alert(name="GPUMemoryLeak", **srv, **slow(server, names.MEMORY_HEADROOM, names.MEMORY_GROWTH_RATE),
              summary="Memory of {{ $labels.instance }} ({{ $labels.device }}) leaks towards exhaustion",
              doc=Doc(what="The server's memory floor keeps rising and will run out (one of the composite's "
                           "three dimensions)",
                      threshold=slow_threshold, window=slow_window, why=slow_why)),
        *running_out("GPUMemoryRunningOut", srv, server, names.MEMORY_HEADROOM_FAST,
                     names.MEMORY_GROWTH_RATE_FAST,
                     "Memory of {{ $labels.instance }} ({{ $labels.device }}) runs out within ",
                     "The server's memory grows fast enough to run out soon (composite dimension: "
                     "memory leak)"),
        Alert(name="GPUFramebufferFillingUp", **exp,
              **slow(gpu, names.GPU_MEMORY_HEADROOM, names.GPU_MEMORY_GROWTH_RATE),
              summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} fills its memory",
              doc=Doc(what="A GPU's framebuffer floor (all processes) keeps rising and will run out",
                      threshold=slow_threshold, window=slow_window,
                      why=slow_why + " Catches processes other than the server.")),
        *running_out("GPUFramebufferRunningOut", exp, gpu, names.GPU_MEMORY_HEADROOM_FAST,
                     names.GPU_MEMORY_GROWTH_RATE_FAST,
                     "GPU {{ $labels.gpu }} on {{ $labels.instance }} runs out of memory within ",
                     "A GPU's framebuffer (all processes) grows fast enough to run out soon"),
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
    alerts += tenant_cap_alerts(p)
    return [Group("gpuscope-memory", tuple(alerts))]


def tenant_cap_alerts(p: Profile) -> list[Alert]:
    """The memory caps of gpuscope share's tenants: near the cap, and allocations refused at it."""
    w, t = p.windows, p.thresholds
    tenant = "Tenant {{ $labels.tenant }} on {{ $labels.instance }}"
    now = _query(names.TENANT_MEMORY_USED + "{}", TENANT_LABELS, "humanize1024")
    cap = _query(names.TENANT_MEMORY_CAP + "{}", TENANT_LABELS, "humanize1024")
    held = _query(f"{names.TENANT_MEMORY_USED}{{}} / {_on(TENANT_LABELS)} {names.TENANT_MEMORY_CAP}",
                  TENANT_LABELS, "humanizePercentage")
    common = {"service": p.selectors.server_service, "dashboard": uids.TENANTS,
              "dashboard_vars": ("instance", "tenant"), "severity": "warning"}
    ratio = num(t.bottleneck_memory_ratio * 100)
    return [
        Alert(name=NEAR_CAP, expr=near_cap_condition(p), for_s=w.memory_cap_for, **common,
              summary="Tenant {{ $labels.tenant }} is near its memory cap on {{ $labels.instance }}",
              description=(f"{tenant} holds {now}B of its {cap}B memory cap "
                           f"({{{{ $value | humanizePercentage }}}}), at least {ratio}% of it for "
                           f"{duration(w.memory_cap_for)}: an allocation past the cap is refused with CUDA "
                           f"out-of-memory."),
              doc=Doc(what="A tenant of gpuscope share holds nearly all of its device-memory cap",
                      threshold=f"used ≥ {ratio}% of the cap (`bottleneck_memory_ratio`, the "
                                f"memory-pressure threshold)",
                      window=f"for {duration(w.memory_cap_for)}",
                      why="At the cap the next allocation fails; the memory-pressure threshold leaves "
                          "room to act first. A burst freed within minutes is not a tenant sized at its "
                          "cap. A server that sizes itself to the memory it sees (vLLM's "
                          "gpu_memory_utilization, of the cap) sits at that fraction by design.")),
        Alert(name=REFUSED, expr=refused_condition(p), for_s=0, **common,
              summary="Allocations of tenant {{ $labels.tenant }} are refused at its memory cap on "
                      "{{ $labels.instance }}",
              description=(f"{tenant} had {{{{ $value }}}} allocations refused at its memory cap over the "
                           f"last {duration(w.latency)}: its processes got CUDA out-of-memory errors. "
                           f"It holds {now}B of its {cap}B cap ({held})."),
              doc=Doc(what="Allocations of a gpuscope share tenant are refused at its memory cap: its "
                           "processes get CUDA out-of-memory errors",
                      threshold="any refused allocation",
                      window=f"refusals over {duration(w.latency)}",
                      why="A refusal is an out-of-memory error in the tenant's process now (PyTorch "
                          "frees its cache and retries first, then raises). Its own alert: one large "
                          f"allocation is refused at any fill level, below {ratio}% too; its "
                          f"description gives the fill level.")),
    ]
