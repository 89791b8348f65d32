"""Every call the server makes into ``gpuscope.timing``, in one place.

``--timing budget`` times model regions within the timer's overhead budget,
``--timing all`` times every region, ``--timing off`` uses no timer at all:
then a step's cost is read from the host clock around a step that ends in a
device sync (the sampled tokens are copied to the host), which is what the
share scheduler gets instead of CUDA-event time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from prometheus_client import CollectorRegistry

from .config import ConfigError, TimingMode

try:
    from gpuscope.timing import Timer, trace
except ImportError:  # the timer package is optional for this module's importers (benchmarks)
    Timer = None
    trace = None

log = logging.getLogger(__name__)

#: Module-path suffixes the model's per-module breakdown uses (op label = module path).
INSTRUMENTED = ("embed", "attn", "mlp", "lm_head")


class _NoInstrument:
    def remove(self) -> None:
        pass


class HostClock:
    """Timer-shaped step clock for ``--timing off``: perf_counter around a synchronizing step."""

    def start(self, op: str, on_elapsed: Callable[[float], Any] | None = None):
        return time.perf_counter(), on_elapsed

    def stop(self, handle) -> None:
        started, callback = handle
        if callback is not None:
            try:
                callback(time.perf_counter() - started)
            except Exception:  # never let accounting break the engine
                log.exception("step accounting failed")

    def instrument(self, model, include=INSTRUMENTED) -> _NoInstrument:
        return _NoInstrument()

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self) -> None:
        pass


def build_timer(mode: TimingMode, registry: CollectorRegistry | None, budget: float = 0.01):
    """The timer for ``--timing MODE``; HostClock when off (or when gpuscope.timing is absent)."""
    if mode == TimingMode.OFF or Timer is None:
        if mode != TimingMode.OFF:
            log.warning("gpuscope.timing is not importable; step times come from the host clock")
        return HostClock()
    if mode == TimingMode.ALL:
        return Timer(registry=registry, sample_rate=1.0)
    return Timer(registry=registry, budget=budget)


def enable_kernel_busy(timer) -> None:
    """``--timing.kernel-busy``: sampled CUPTI windows over the instrumented modules
    (``gpuscope.timing.busy``), or a one-line ConfigError where they cannot run."""
    route = getattr(timer, "route", None)
    if route is None or route.on_host:
        raise ConfigError("--timing.kernel-busy needs a CUDA GPU (the timer runs on the host clock here)")
    try:
        timer.enable_kernel_busy()
    except RuntimeError as exc:
        raise ConfigError(f"--timing.kernel-busy: {exc}") from None


def instrument_model(timer, model):
    """Per-module GPU-time histograms (embed / attn / mlp / lm_head); ``.remove()`` undoes it."""
    return timer.instrument(model, include=INSTRUMENTED)


def trace_context(trace_id: str | None) -> AbstractContextManager:
    """Make ``trace_id`` the exemplar of the timer's observations inside the block."""
    if trace is None or not trace_id:
        return nullcontext()
    return trace(trace_id)
