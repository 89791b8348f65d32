"""What one window of observation boils down to: the numbers every verdict reads.

Live sampling (``live.py``) and a past window read from Prometheus (``history.py``) both produce a
:class:`Summary`, so the verdicts are the same whichever way the numbers were obtained. Ratios are
0..1, times in seconds, ``None`` where the number could not be read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class GpuSummary:
    """One GPU over the window."""

    label: str
    util_mean: float | None = None
    util_min: float | None = None
    util_max: float | None = None
    #: Highest framebuffer use over the window, as a share of the total.
    memory_used_ratio: float | None = None
    #: Growth of the framebuffer's use (bytes/s) where it grew throughout the window (a leak's sign).
    memory_growth_bytes_per_s: float | None = None
    sm_clock_hz: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    #: Clock event (throttle) reason → share of the window it was active.
    clock_events: dict[str, float] = field(default_factory=dict)
    #: XID code → how many were reported within the window.
    xids: dict[str, float] = field(default_factory=dict)

    @property
    def util_swing(self) -> float | None:
        if self.util_min is None or self.util_max is None:
            return None
        return self.util_max - self.util_min


@dataclass
class OpSummary:
    """One timed op (the timer's regions) over the window."""

    p50_s: float | None = None
    #: Share of the op's region time its kernels kept the GPU busy (kernel busy windows), if measured.
    busy_ratio: float | None = None


@dataclass
class ServerSummary:
    """The inference server (gpuscope serve or vLLM) over the window."""

    source: str
    running: float | None = None
    waiting: float | None = None
    kv_cache_max: float | None = None
    preemptions: float | None = None
    tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    queue_p50_s: float | None = None
    #: Growth of the serving process' memory floor (bytes/s), where a leak record says it grows.
    memory_growth_bytes_per_s: float | None = None
    ops: dict[str, OpSummary] = field(default_factory=dict)


@dataclass
class Summary:
    """Host, GPUs and server over one window."""

    source: str  # "live" or "prometheus"
    window_s: float
    host: str = ""
    #: Whole-host CPU busy share (all cores), the classic figure.
    cpu: float | None = None
    #: Busiest single core: one Python thread feeding the GPU shows here, not in ``cpu``.
    cpu_busiest_core: float | None = None
    ram_used_ratio: float | None = None
    gpus: list[GpuSummary] = field(default_factory=list)
    server: ServerSummary | None = None
    #: What could not be read, in words (shown, never fatal).
    unavailable: list[str] = field(default_factory=list)

    def gpu_util_mean(self) -> float | None:
        values = [g.util_mean for g in self.gpus if g.util_mean is not None]
        return sum(values) / len(values) if values else None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
