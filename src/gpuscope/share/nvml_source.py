"""Per-process GPU utilization from NVML, for ``--share.accounting nvml`` (the peers' signal).

NVML keeps per-process utilization samples at its own pace, often slower than the controller's
100 ms polls, so a poll frequently brings nothing new for a busy process. ``SampleHold`` keeps each
process's last value until a newer one arrives (or it goes stale), as the peers' watchers do;
without it a bucket drained only on the polls that happen to bring a sample barely drains at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

Sampler = Callable[[], Mapping[int, float]]  # pid -> fraction of the GPU in samples new since last call


class SampleHold:
    """pid -> the last utilization NVML reported for it, for at most ``hold_s`` after the report."""

    def __init__(self, fresh: Sampler, hold_s: float = 1.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh = fresh
        self.hold_s = hold_s
        self.clock = clock
        self.last: dict[int, tuple[float, float]] = {}

    def __call__(self) -> dict[int, float]:
        now = self.clock()
        for pid, fraction in self.fresh().items():
            self.last[pid] = (fraction, now)
        self.last = {pid: v for pid, v in self.last.items() if now - v[1] <= self.hold_s}
        return {pid: fraction for pid, (fraction, _) in self.last.items()}


def process_samples(index: int) -> Callable[[], list]:
    """NVML's per-process utilization samples of GPU ``index`` newer than the last call's."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    state = {"last": 0}

    def read() -> list:
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, state["last"])
        except pynvml.NVMLError:
            return []  # no sample since the last call (NVML says "not found")
        for s in samples:
            state["last"] = max(state["last"], s.timeStamp)
        return list(samples)

    return read


def nvml_utilization(index: int) -> SampleHold:
    """pid -> SM utilization (fraction) of GPU ``index``, held between NVML's samples."""
    samples = process_samples(index)

    def fresh() -> dict[int, float]:
        out: dict[int, float] = {}
        for s in samples():
            out[s.pid] = max(out.get(s.pid, 0.0), s.smUtil / 100.0)
        return out

    return SampleHold(fresh)
