"""Prometheus collector for a timer: builds fresh families from cached state at scrape time.

Exposes (names from the catalogue)::

    gpuscope_region_gpu_seconds_bucket{op="blocks.0.attn",device="0",le="0.0001"} 118
    gpuscope_regions_entered_total{op="blocks.0.attn"} 2301
    gpuscope_timer_dropped_samples_total{reason="ring_full"} 0
    gpuscope_timer_sampling_ratio{op="blocks.0.attn"} 0.0625
    gpuscope_timer_hot_path_seconds 1.2e-05
    gpuscope_timer_overhead_ratio 0.0093
    gpuscope_timer_overhead_budget_ratio 0.01
    gpuscope_timer_baseline_seconds{device="0"} 1.3e-06
    gpuscope_timer_resolver_lag_seconds 0.0
    gpuscope_timer_pending_samples 12
    gpuscope_timer_backend_info{backend="cudart-ctypes"} 1
    gpuscope_region_gpu_busy_ratio{op="blocks.0.attn",device="0"} 0.31   (kernel busy window on)
    gpuscope_region_kernel_seconds{op="blocks.0.attn",device="0"} 0.00021
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from gpuscope.contract import catalogue as c

if TYPE_CHECKING:
    from gpuscope.timing.budget import BudgetController
    from gpuscope.timing.core import TimerCore
    from gpuscope.timing.resolver import Resolver


#: Every family the collector yields (the kernel busy window's only while it is on): the catalogue's
#: timing metrics.
METRICS = tuple(m for m in c.all_metrics() if m.area == c.TIMING)


class TimerCollector(Collector):
    def __init__(self, core: TimerCore, resolver: Resolver, budget: BudgetController) -> None:
        self.core = core
        self.resolver = resolver
        self.budget = budget

    def describe(self) -> Iterator:
        """The families by name, type and help, without timer state: what a registry checks for
        names another collector of it already has."""
        return (metric.family() for metric in METRICS)

    def collect(self) -> Iterator:
        core, resolver = self.core, self.resolver
        ops = core.ops()
        hist = c.REGION_GPU_SECONDS.family()
        entered = c.REGIONS_ENTERED.family()
        ratio = c.TIMER_SAMPLING_RATIO.family()
        for op in ops:
            owner = op.owner
            if owner is None:
                entered.add_metric([op.name], op.entered)
                ratio.add_metric([op.name], 1.0 / op.period)
            else:  # instrument(): sampled per forward pass, counted on sampled passes
                entered.add_metric([op.name], round(op.entered * owner.entered_scale()))
                ratio.add_metric([op.name], 1.0 / owner.pass_state.period)
            for device, h in list(op.hists.items()):
                buckets = []
                for le, count, exemplar in h.cumulative():
                    if exemplar is None:
                        buckets.append((le, count))
                    else:
                        trace_id, value, ts = exemplar
                        buckets.append((le, count, Exemplar({"trace_id": trace_id}, value, ts)))
                hist.add_metric([op.name, core.device_label(device)], buckets, h.sum)
        yield hist
        yield entered
        yield ratio
        dropped = c.TIMER_DROPPED.family()
        for reason, n in core.dropped.items():
            dropped.add_metric([reason], n)
        yield dropped
        for metric, value in (
            (c.TIMER_HOT_PATH_SECONDS, core.hot_path_s),
            (c.TIMER_OVERHEAD_RATIO, self.budget.overhead_ratio),
            (c.TIMER_OVERHEAD_BUDGET_RATIO, core.budget),
            (c.TIMER_RESOLVER_LAG_SECONDS, resolver.lag_s),
            (c.TIMER_PENDING, core.pending()),
        ):
            family = metric.family()
            family.add_metric([], value)
            yield family
        baseline = c.TIMER_BASELINE_SECONDS.family()
        for device, seconds in list(resolver.baseline_s.items()):
            baseline.add_metric([core.device_label(device)], seconds)
        yield baseline
        busy = core.busy
        if busy is not None:
            ratios = c.REGION_GPU_BUSY_RATIO.family()
            for (op, device), ratio in list(busy.ratios.items()):
                ratios.add_metric([op, device], ratio)
            yield ratios
            kernel = c.REGION_KERNEL_SECONDS.family()
            for (op, device), seconds in list(busy.kernel_seconds.items()):
                kernel.add_metric([op, device], seconds)
            yield kernel
            windows = c.TIMER_KERNEL_BUSY_WINDOWS.family()
            for outcome, n in busy.windows.items():
                windows.add_metric([outcome], n)
            yield windows
            cost = c.TIMER_KERNEL_BUSY_COST_SECONDS.family()
            cost.add_metric([], busy.cost_s)
            yield cost
        info = c.TIMER_BACKEND.family()
        info.add_metric([], {"backend": core.route.name})
        yield info
