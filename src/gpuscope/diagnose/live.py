"""Sampling a live window: host, GPUs and server once per interval, then a :class:`Summary`.

:class:`Window` keeps every reading (a window is seconds to minutes long: a few hundred small
records) so the summary can take means, extremes, counter increases and histogram quantiles over the
whole window, and the terminal view can show the latest values while it fills. The CPU times of
processes are read only at the window's two ends (``processes.py``): their difference is the rate.
"""

from __future__ import annotations

import itertools
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuscope.contract import catalogue as cat
from gpuscope.diagnose import processes, scrape
from gpuscope.diagnose.findings import Limits
from gpuscope.diagnose.gpus import GpuSampler, Reading
from gpuscope.diagnose.host import HostReading, HostSampler
from gpuscope.diagnose.processes import CpuSnapshot, GpuUse, ProcReader
from gpuscope.diagnose.summary import GpuSummary, OpSummary, ServerSummary, Summary

_PROC_MEMORY = cat.GPU_PROCESS_MEMORY.name
_PROC_SM = cat.GPU_PROCESS_SM_UTILIZATION.name


@dataclass
class Tick:
    at: float
    host: HostReading
    gpus: Reading
    server: scrape.ServerReading | None


@dataclass
class Window:
    ticks: list[Tick] = field(default_factory=list)
    server_error: str = ""
    #: The server URL scraped ("" when none), whether the user named it, and how its scrapes went.
    server_url: str = ""
    server_asked: bool = False
    server_tried: int = 0
    server_failed: int = 0
    #: When sampling began (the CPU baseline reading): the window spans from here to the last tick.
    started: float | None = None
    #: Processes' CPU times at the window's start and end, and the command lines of those on a GPU.
    cpu_before: CpuSnapshot | None = None
    cpu_after: CpuSnapshot | None = None
    commands: dict[int, str] = field(default_factory=dict)

    def summary(self, host_name: str = "", limits: Limits | None = None) -> Summary:
        lim = limits or Limits()
        begin = self.started if self.started is not None else self.ticks[0].at
        span = self.ticks[-1].at - begin if self.ticks else 0.0
        out = Summary("live", round(span, 2), host=host_name)
        out.cpu = _mean(t.host.cpu for t in self.ticks)
        out.cpu_busiest_core = _mean(t.host.busiest_core for t in self.ticks)
        out.ram_used_ratio = _max(t.host.ram_used_ratio for t in self.ticks)
        out.cpu_cores = next((t.host.cores for t in reversed(self.ticks) if t.host.cores), None)
        labels = sorted({g for t in self.ticks for g in t.gpus}, key=lambda x: (len(x), x))
        out.gpus = [self._gpu(label, span, lim.leak_growth_share) for label in labels]
        out.processes = processes.join(self.gpu_use(), self.cpu_before, self.cpu_after, self.commands)
        out.server = self._server(span)
        out.server_asked = self.server_url if self.server_asked else ""
        out.server_tried, out.server_failed = self.server_tried, self.server_failed
        out.server_error = self.server_error
        if not labels:
            out.unavailable.append("GPUs (NVML not available)")
        unseen = [str(p.pid) for p in out.processes if p.cpu is None]
        if self.cpu_after is not None and unseen:
            out.unavailable.append(f"CPU of GPU process(es) {', '.join(unseen)} (not in this /proc: another "
                                   "PID namespace, or gone; run with the host's PIDs)")
        if out.server is None:
            why = f"{self.server_url}: {self.server_error}" if self.server_error else "not asked"
            out.unavailable.append(f"server metrics ({why})")
        return out

    def gpu_pids(self) -> set[int]:
        """Every pid NVML listed on a GPU during the window."""
        return {int(pid) for t in self.ticks for metrics in t.gpus.values()
                for name in (_PROC_MEMORY, _PROC_SM) for pid in metrics.get(name, {})}

    def gpu_use(self) -> dict[int, GpuUse]:
        """pid → what NVML said of it: memory (highest per GPU, summed over its GPUs), its own SM
        utilization and its GPUs' utilization (means over the window, the busiest GPU's)."""
        out: dict[int, GpuUse] = {}
        for label in {g for t in self.ticks for g in t.gpus}:
            def values(name: str, key: str = "", label: str = label) -> list[float | None]:
                return [t.gpus.get(label, {}).get(name, {}).get(key) for t in self.ticks]

            device = _mean(values(cat.GPU_UTILIZATION.name))
            pids = {pid for t in self.ticks for name in (_PROC_MEMORY, _PROC_SM)
                    for pid in t.gpus.get(label, {}).get(name, {})}
            for pid in pids:
                use = out.setdefault(int(pid), GpuUse())
                use.gpus.add(label)
                use.memory_bytes = _sum_known(use.memory_bytes, _max(values(_PROC_MEMORY, pid)))
                use.sm_util = _max((use.sm_util, _mean(values(_PROC_SM, pid))))
                use.gpu_util = _max((use.gpu_util, device))
        return out

    def _gpu(self, label: str, span: float, leak_growth_share: float) -> GpuSummary:
        def series(name: str, key: str = "") -> list[float]:
            return [v for t in self.ticks if (v := t.gpus.get(label, {}).get(name, {}).get(key)) is not None]

        util = series(cat.GPU_UTILIZATION.name)
        used, total = series(cat.GPU_MEMORY_USED.name), series(cat.GPU_MEMORY_TOTAL.name)
        g = GpuSummary(label, util_mean=_mean(util), util_min=_min(util), util_max=_max(util))
        if used and total and total[-1]:
            g.memory_used_ratio = max(used) / total[-1]
            grew = used[-1] - used[0]
            monotone = all(b >= a for a, b in itertools.pairwise(used))
            if span > 0 and monotone and grew >= leak_growth_share * total[-1]:
                g.memory_growth_bytes_per_s = grew / span
        g.sm_clock_hz = _mean(series(cat.GPU_SM_CLOCK.name))
        g.power_w = _mean(series(cat.GPU_POWER.name))
        g.power_limit_w = _max(series(cat.GPU_POWER_LIMIT.name))
        reasons = {k for t in self.ticks
                   for k in t.gpus.get(label, {}).get(cat.GPU_CLOCK_EVENT_ACTIVE.name, {})}
        for reason in sorted(reasons):
            active = series(cat.GPU_CLOCK_EVENT_ACTIVE.name, reason)
            if active:
                g.clock_events[reason] = round(sum(active) / len(active), 4)
        first, last = self.ticks[0].gpus.get(label, {}), self.ticks[-1].gpus.get(label, {})
        for code, n in last.get(cat.GPU_XID_ERRORS.name, {}).items():
            if (delta := n - first.get(cat.GPU_XID_ERRORS.name, {}).get(code, 0.0)) > 0:
                g.xids[code] = delta
        return g

    def _server(self, span: float) -> ServerSummary | None:
        readings = [t.server for t in self.ticks if t.server is not None]
        if not readings:
            return None
        first, last = readings[0], readings[-1]
        s = ServerSummary(last.source)
        s.running = _mean(r.gauges.get("running") for r in readings)
        s.waiting = _mean(r.gauges.get("waiting") for r in readings)
        s.kv_cache_max = _max(r.gauges.get("kv_cache") for r in readings)
        if "preemptions" in last.counters:
            s.preemptions = last.counters["preemptions"] - first.counters.get("preemptions", 0.0)
        if "generation_tokens" in last.counters and span > 0:
            made = last.counters["generation_tokens"] - first.counters.get("generation_tokens", 0.0)
            s.tokens_per_s = made / span
        for key, attrs in (("ttft", ("ttft_p50_s", "ttft_p99_s")), ("itl", ("itl_p50_s", "itl_p99_s")),
                           ("queue", ("queue_p50_s", None))):
            if key in last.histograms:
                before = first.histograms.get(key, {}) if len(readings) > 1 else {}
                setattr(s, attrs[0], scrape.quantile(0.5, before, last.histograms[key]))
                if attrs[1]:
                    setattr(s, attrs[1], scrape.quantile(0.99, before, last.histograms[key]))
        for op in sorted(set(last.regions) | set(last.busy)):
            before = first.regions.get(op, {}) if len(readings) > 1 else {}
            p50 = scrape.quantile(0.5, before, last.regions[op]) if op in last.regions else None
            busy = _mean(r.busy.get(op) for r in readings)
            s.ops[op] = OpSummary(p50, busy)
        return s


def _sum_known(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else (a or 0.0) + (b or 0.0)


def _clean(values) -> list[float]:
    return [v for v in values if v is not None]


def _mean(values) -> float | None:
    v = _clean(values)
    return sum(v) / len(v) if v else None


def _min(values) -> float | None:
    v = _clean(values)
    return min(v) if v else None


def _max(values) -> float | None:
    v = _clean(values)
    return max(v) if v else None


class LiveSampler:
    """Reads host, GPUs and server every ``interval`` for ``duration`` seconds, and the CPU times of
    processes at both ends.

    ``server_asked``: the user named ``server_url`` (a flag or its environment variable), so a server
    that does not answer there is a finding; otherwise it is the default address, tried on the chance.
    """

    def __init__(self, duration: float, interval: float, server_url: str | None, *, nv=None,
                 proc_root: str = "/proc", gpu_sampler: GpuSampler | None = None,
                 host_sampler: HostSampler | None = None, server_asked: bool = False) -> None:
        self.duration, self.interval, self.server_url = duration, interval, server_url
        self.host = host_sampler or HostSampler(proc_root)
        self.gpus = gpu_sampler or GpuSampler(interval=min(interval, 0.5), nv=nv)
        self.procs = ProcReader(proc_root)
        self.window = Window(server_url=server_url or "", server_asked=server_asked)

    def _server(self) -> scrape.ServerReading | None:
        if not self.server_url:
            return None
        self.window.server_tried += 1
        try:
            return scrape.fetch(self.server_url, timeout=min(2.0, max(0.2, self.interval)))
        except (OSError, ValueError, KeyError) as exc:  # unreachable, refused, not an exposition, no ``le``
            self.window.server_failed += 1
            # urlopen wraps the socket's error ("<urlopen error [Errno 111] ...>"): say the reason itself.
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            self.window.server_error = str(reason) or type(reason).__name__
            return None

    def _processes_at_end(self) -> None:
        """The second CPU reading: the processes NVML listed, their threads and (in the same
        listing) their descendants; and their command lines."""
        pids = self.window.gpu_pids()
        self.window.cpu_after = self.procs.snapshot(threads_of=pids)
        self.window.commands = {pid: self.procs.command(pid) for pid in pids}

    def run(self, on_tick: Callable[[Window, float], None] | None = None) -> Window:
        """Sample until the window is full; ``on_tick(window, elapsed share)`` after each reading."""
        self.gpus.start()
        try:
            self.window.cpu_before = self.procs.snapshot()  # which pids are on a GPU is not known yet
            self.host.read()  # the first CPU reading is a baseline for the next
            started = self.window.started = time.monotonic()
            deadline = started + self.duration
            next_at = started
            while True:
                next_at += self.interval
                # Sleeping until the next tick is the sampling cadence itself, not a wait on an event.
                time.sleep(max(0.0, next_at - time.monotonic()))
                now = time.monotonic()
                self.window.ticks.append(Tick(now, self.host.read(), self.gpus.read(), self._server()))
                if on_tick is not None:
                    on_tick(self.window, min(1.0, (now - started) / self.duration))
                if now >= deadline:
                    return self.window
        finally:
            # Also on Ctrl-C: what was sampled so far is judged, processes included.
            self._processes_at_end()
            self.gpus.stop()
