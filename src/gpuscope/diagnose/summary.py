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
class TaskSummary:
    """A thread or a child process over the window; ``cpu`` in cores (1.0: one core all the time)."""

    id: int
    name: str
    cpu: float


@dataclass
class ProcessSummary:
    """A process holding a GPU (NVML's compute processes) joined with its CPU side (/proc)."""

    pid: int
    #: Its command line (``comm`` where the command line cannot be read).
    command: str
    gpus: list[str] = field(default_factory=list)
    #: Device memory it held (highest over the window, summed over its GPUs).
    memory_bytes: float | None = None
    #: Its own SM utilization (NVML's per-process samples, mean over the window; its busiest GPU);
    #: None where the driver keeps no per-process samples.
    sm_util: float | None = None
    #: Utilization of the GPUs it is on (mean over the window; the busiest of them).
    gpu_util: float | None = None
    #: CPU of the whole process (every thread), in cores; None where /proc does not show it.
    cpu: float | None = None
    busiest_thread: TaskSummary | None = None
    threads: int = 0
    #: Its descendant processes that hold no GPU themselves (data-loader workers), busiest first.
    workers: list[TaskSummary] = field(default_factory=list)

    @property
    def gpu_busy(self) -> float | None:
        """How busy its GPU is: the higher of its own SM utilization and its GPU's utilization. A
        neighbour keeping the GPU busy means the GPU does not wait for this process; and a driver
        whose per-process samples never come (0 for every process) must not read as a starved GPU."""
        known = [v for v in (self.sm_util, self.gpu_util) if v is not None]
        return max(known) if known else None


@dataclass
class Summary:
    """Host, GPUs, the processes on them and the server over one window."""

    source: str  # "live" or "prometheus"
    window_s: float
    host: str = ""
    #: Whole-host CPU busy share (all cores), the classic figure.
    cpu: float | None = None
    #: Busiest single core: one Python thread feeding the GPU shows here, not in ``cpu``.
    cpu_busiest_core: float | None = None
    ram_used_ratio: float | None = None
    #: Cores the host has (from /proc/stat), where known.
    cpu_cores: int | None = None
    gpus: list[GpuSummary] = field(default_factory=list)
    #: Every process holding a GPU (live windows only: Prometheus keeps no per-thread CPU).
    processes: list[ProcessSummary] = field(default_factory=list)
    server: ServerSummary | None = None
    #: The server address the user named (flag or environment): one that never answered is a finding,
    #: unlike the default address tried on the chance that a server runs there. "" when not named.
    server_asked: str = ""
    #: Scrapes of the server tried and failed over the window, and the last failure's text.
    server_tried: int = 0
    server_failed: int = 0
    server_error: str = ""
    #: What could not be read, in words (shown, never fatal).
    unavailable: list[str] = field(default_factory=list)

    def gpu_util_mean(self) -> float | None:
        values = [g.util_mean for g in self.gpus if g.util_mean is not None]
        return sum(values) / len(values) if values else None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
