"""CUDA-event timing of GPU work at close to the driver's own cost.

    from gpuscope.timing import Timer, trace

    timer = Timer()                       # CUDA events if torch sees a GPU, else wall time
    with timer.region("attention"):       # also a decorator
        ...
    h = timer.start("prefill"); ...; timer.stop(h)
    timer.instrument(model)               # per-module breakdown (attn, mlp, embed, lm_head ...)
    with trace(trace_id): ...             # exemplars link histogram buckets to this request

Samples land in ``gpuscope_region_gpu_seconds{op,device}`` on the registry's
``/metrics``. See README ("Timing your own server") for the cost model.
"""

from __future__ import annotations

import threading

from gpuscope.timing.core import current_trace_id, trace
from gpuscope.timing.graphs import TimedGraph
from gpuscope.timing.instrument import DEFAULT_NAMES, Instrumentation, instrument
from gpuscope.timing.sequence import Sequence
from gpuscope.timing.timer import Handle, Region, Timer

_default: Timer | None = None
_default_lock = threading.Lock()


def default_timer() -> Timer:
    """The process-wide timer (created on first use, registered in prometheus_client's REGISTRY)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Timer()
    return _default


def region(op: str) -> Region:
    """``with region("op"):`` on the process-wide timer."""
    return default_timer().region(op)


__all__ = [
    "DEFAULT_NAMES",
    "Handle",
    "Instrumentation",
    "Region",
    "Sequence",
    "TimedGraph",
    "Timer",
    "current_trace_id",
    "default_timer",
    "instrument",
    "region",
    "trace",
]
