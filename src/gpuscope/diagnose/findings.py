"""What a verdict is (:class:`Finding`) and every threshold the verdicts use (:class:`Limits`).

Both verdict modules (``verdicts`` for host, GPUs and server; ``process_verdicts`` for the processes
on the GPUs) read their thresholds from here, so each number is written once, with why it is what it
is; the tests pass their own ``Limits`` where a loaded test machine cannot reach the real ones. What
the alert rules also judge (memory pressure, launch-bound ops, a full KV cache, throttling, XIDs) is
read from the rules' own thresholds (``shared``: ``contract/profiles.py``), not restated here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from gpuscope.contract.profiles import Thresholds

Severity = Literal["problem", "warning"]


@dataclass(frozen=True)
class Limits:
    """The classic script's thresholds, the ones this command adds, and the alert rules' (``shared``)."""

    input_cpu: float = 0.90
    input_gpu: float = 0.30
    #: A GPU whose memory is at least ``shared.bottleneck_memory_ratio`` full (the rules' memory
    #: pressure) with its utilization swinging by this much within the window is thrashing.
    memory_swing: float = 0.30
    idle_cpu: float = 0.40
    idle_gpu: float = 0.40
    #: A core, or one thread, at least this busy (share of one core) is saturated: a Python thread
    #: feeding a GPU kernel by kernel runs at nearly a full core; the margin leaves room for the
    #: sampling's rounding (docs/diagnose.md, "Why these numbers").
    saturated_core: float = 0.90
    #: A GPU kept busy less than this while the thread feeding it is saturated waits on the host: a
    #: GPU-bound loop keeps it nearly always busy even with a Python thread at 100% (the thread then
    #: spins in a synchronisation); a launch-bound one far less (docs/diagnose.md, "Why these numbers").
    starved_gpu: float = 0.60
    #: A child process using at least this share of a core is an active worker; a resource tracker,
    #: a fork server or an idle worker between epochs uses none.
    worker_active: float = 0.05
    #: Active workers using at least this share of a core each, on average, are working flat out (a
    #: worker waiting for its queue to drain sits well below; 80% leaves room for I/O waits).
    worker_saturated: float = 0.80
    #: ... or the host is saturated (``input_cpu``) and the workers use at least this share of its cores:
    #: more workers than cores, each getting only its slice of the machine.
    worker_host_share: float = 0.5
    #: A process holding a GPU is idle below both: its SM utilization (NVML rounds to whole percent,
    #: so 1% is "nothing") and its CPU with its workers (a sleeping interpreter wakes a few times a
    #: second: well under 2% of a core).
    idle_holder_sm: float = 0.01
    idle_holder_cpu: float = 0.02
    #: Requests in flight (mean over the window) before idle hardware counts as waiting requests.
    min_running: float = 0.5
    #: Queueing dominates when the median queue wait is at least this share of the median TTFT.
    queue_share: float = 0.5
    #: Memory that grew throughout the window by at least this share of the total is reported.
    leak_growth_share: float = 0.01
    shared: Thresholds = field(default_factory=Thresholds)


@dataclass
class Finding:
    code: str
    severity: Severity
    title: str
    #: The numbers that triggered it (names as shown; ratios 0..1, seconds).
    evidence: dict[str, float | str]
    next_step: str
    where: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def shown(value: float | None) -> float | str:
    """A number as evidence shows it: rounded, or ``n/a`` where it could not be read."""
    return "n/a" if value is None else round(value, 4)
