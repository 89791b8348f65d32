"""The overhead budget: how often regions are sampled, so that timing costs at most ``budget`` of
the time the program is busy in timed code.

Once a second (on the resolver thread) ``BudgetController.adapt`` gathers what happened since the
last decision into a ``Window`` and ``decide`` turns it into a sampling period. ``decide`` is a
pure function of the window, so its behaviour is tested with chosen numbers rather than with how
fast a machine happens to run.

The cost model, against the wall time of the resolver intervals in which timed code ran (a server
idle half the time must not spend its whole budget in the busy half)::

    cost = sampled direct regions × hot path + unsampled direct regions × skip cost
         + sampled passes × (their measured extra CPU, and the switch back to the untimed graph
                             after a run of them under default compile; on a GPU there, times
                             what that CPU was measured to miss)   [instrument(), per pass]
         + resolved samples × resolution cost + the resolver's wake-ups in busy intervals

Regions started with ``on_elapsed`` are timed every time: their cost comes off the allowance
first, and only the rest is shared among the regions sampling can thin (when they alone exceed
the budget, the rest is sampled at the floor rate and the overhead ratio shows the excess).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpuscope.timing.core import TimerCore

ADAPT_EVERY_S = 1.0
MIN_SAMPLING_RATIO = 1 / 4096
#: Records cost several times more inside a forward pass than in an idle loop (docs/design.md,
#: "Inside a real forward pass"); the in-context factor applied to the idle cost of an unsampled
#: region is capped here (a "record" on the host route is a clock read, and the raw ratio means
#: nothing there).
MAX_CONTEXT_FACTOR = 4.0
#: The period rises at most this factor per decision, and falls at most MAX_STEP_DOWN: one noisy
#: window cannot swing the rate, and sampling is taken back faster (4x a decision) than it is given
#: (1.5x). A
#: sampled pass's cost is measured in the program, and its estimate jumps between windows (14 to
#: 249 µs a pass on the CPU host's compiled chain, one window to the next); falling 4× on a low read,
#: the period swung between 4 and 23 and the windows' overhead averaged over the budget.
MAX_STEP = 4
MAX_STEP_DOWN = 1.5
#: The part of the budget the period aims at. Each window's costs are measured in the program and
#: vary from one window to the next; aimed at the whole budget, the windows' overhead averaged over
#: it (1.05-1.08% of a 1% budget on the CPU host's compiled chain).
BUDGET_AIM = 0.85


@dataclass(frozen=True)
class PassWindow:
    """One instrumentation's passes in the window (``instrument()`` samples per forward pass)."""

    passes: float
    sampled: float
    per_pass_s: float  # extra CPU of a sampled pass, its switch back included (measured in the program,
    #                    floored by the records)
    samples_per_pass: int


@dataclass(frozen=True)
class Window:
    """What happened since the last decision, and the unit costs measured meanwhile."""

    wall_s: float  # wall time of the resolver intervals in which timed code ran
    direct_entered: float  # regions entered outside instrument() passes
    always: float  # of those, started with on_elapsed: timed every time
    resolved: float  # samples resolved
    resolve_busy_s: float  # resolver CPU spent resolving them
    resolver_fixed_s: float  # the rest of the resolver's CPU, in the busy intervals
    hot_s: float  # cost of a sampled region, in context
    skip_s: float  # cost of an unsampled region, in context
    passes: tuple[PassWindow, ...] = field(default_factory=tuple)


def decide(window: Window, budget: float, period: int, fixed_rate: bool) -> tuple[int, float]:
    """(the new sampling period, the estimated overhead ratio of the window)."""
    w = window
    if w.wall_s <= 0:
        return period, 0.0
    per_resolved = w.resolve_busy_s / w.resolved if w.resolved else 0.0
    pass_spent = pass_full = pass_samples = 0.0
    for p in w.passes:
        pass_spent += p.sampled * p.per_pass_s
        pass_full += p.passes * (p.per_pass_s + p.samples_per_pass * per_resolved)
        pass_samples += p.sampled * p.samples_per_pass
    direct_sampled = max(0.0, w.resolved - pass_samples)
    spent = (direct_sampled * w.hot_s + max(0.0, w.direct_entered - direct_sampled) * w.skip_s
             + pass_spent + w.resolve_busy_s + w.resolver_fixed_s)
    overhead = spent / w.wall_s
    thinnable = max(0.0, w.direct_entered - w.always)
    full = thinnable * (w.hot_s + per_resolved) + pass_full
    if fixed_rate or full <= 0:
        return period, overhead
    allowance = (BUDGET_AIM * budget * w.wall_s - w.resolver_fixed_s - thinnable * w.skip_s
                 - w.always * (w.hot_s + per_resolved))
    ratio = min(1.0, max(MIN_SAMPLING_RATIO, allowance / full))
    target = max(1, round(1 / ratio))
    return min(max(target, int(period / MAX_STEP_DOWN), 1), max(1, period * MAX_STEP)), overhead


class BudgetController:
    """Measures the unit costs, gathers windows and applies ``decide`` to a timer's core."""

    def __init__(self, core: TimerCore) -> None:
        self.core = core
        self.overhead_ratio = 0.0
        self.skip_cost_idle_s = 0.0
        self.record_cost_idle_s = 0.0
        self._last: dict[str, float] = {}

    def measure_skip_cost(self) -> None:
        """CPU cost of an unsampled region on an idle thread (once, at start)."""
        core = self.core
        probe = core.new_pass_state("probe")
        probe.period = probe.countdown = 1 << 30
        n = 2000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            core.begin(probe)
        self.skip_cost_idle_s = (time.perf_counter_ns() - t0) * 1e-9 / n

    def measure_record_cost(self, event: Any, stream: int) -> None:
        """CPU cost of a sampled region's two records on an idle thread (``event``'s device current)."""
        route = self.core.route
        n = 200
        t0 = time.perf_counter_ns()
        for _ in range(n):
            route.record(event, stream)
        self.record_cost_idle_s = 2 * (time.perf_counter_ns() - t0) * 1e-9 / n
        deadline = time.monotonic() + 1.0
        while route.gpu_queue and not route.query(event) and time.monotonic() < deadline:
            time.sleep(0.0002)

    def skip_cost_s(self) -> float:
        """Estimated in-context cost of an unsampled region: the idle figure scaled by how much
        dearer a sampled region is in context than idle, at most MAX_CONTEXT_FACTOR."""
        hot = self.core.hot_path_s
        if hot and self.record_cost_idle_s:
            factor = min(MAX_CONTEXT_FACTOR, max(1.0, hot / self.record_cost_idle_s))
            return self.skip_cost_idle_s * factor
        return self.skip_cost_idle_s

    def activity(self) -> int:
        """Changes whenever any timed code ran: regions entered and instrumented passes."""
        core = self.core
        return sum(op.entered for op in core.ops()) + sum(s.passes for s in core.samplers())

    def start_window(self, now: float, resolver_counters: dict[str, float]) -> None:
        self._last = self._counters(now, resolver_counters)

    def due(self, now: float) -> bool:
        return now - self._last.get("now", now) >= ADAPT_EVERY_S

    def _counters(self, now: float, resolver_counters: dict[str, float]) -> dict[str, float]:
        core = self.core
        counters = {"now": now, "cpu": time.thread_time(), **resolver_counters}
        direct = [op for op in core.ops() if op.owner is None]
        counters["direct_entered"] = sum(op.entered for op in direct)
        counters["always"] = sum(op.always for op in direct)  # a subset of direct_entered
        for sampler in core.samplers():
            counters[f"passes:{id(sampler)}"] = sampler.passes
            counters[f"sampled:{id(sampler)}"] = sampler.sampled_passes
        return counters

    def adapt(self, now: float, resolver_counters: dict[str, float]) -> None:
        """Close the window (on the resolver thread), decide, and apply the new period.

        ``resolver_counters``: cumulative ``busy`` (CPU resolving), ``resolved``, ``active`` (wall
        of busy intervals), ``wakes`` and ``active_wakes`` of the resolver.
        """
        core = self.core
        before, after = self._last, self._counters(now, resolver_counters)
        self._last = after
        delta = {key: after[key] - before.get(key, 0) for key in after}
        hot = core.hot_path_s or self.record_cost_idle_s
        passes = []
        for sampler in core.samplers():
            per_region = hot if sampler.mode == "exact" else hot / 2
            # The in-program measurement is noisy (pass-to-pass jitter): never trust it below what
            # the records alone cost in context.
            floor = per_region * sampler.samples_per_pass()
            passes.append(PassWindow(
                passes=delta.get(f"passes:{id(sampler)}", 0), sampled=delta.get(f"sampled:{id(sampler)}", 0),
                per_pass_s=max(sampler.sampled_pass_cost_s() or 0.0, floor),
                samples_per_pass=sampler.samples_per_pass()))
        window = Window(
            wall_s=delta["active"], direct_entered=delta["direct_entered"], always=delta["always"],
            resolved=delta["resolved"], resolve_busy_s=delta["busy"],
            resolver_fixed_s=max(0.0, delta["cpu"] - delta["busy"]) * (
                delta["active_wakes"] / delta["wakes"] if delta["wakes"] else 1.0),
            hot_s=hot, skip_s=self.skip_cost_s(), passes=tuple(passes))
        if window.wall_s <= 0:
            return
        period, self.overhead_ratio = decide(window, core.budget, core.period, core.fixed_rate)
        if period != core.period:
            core.set_period(period)
