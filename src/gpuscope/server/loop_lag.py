"""How late the HTTP event loop runs, and how long engine events wait for it (two histograms).

The engine thread and the aiohttp loop share one interpreter: while the engine holds the GIL (Python
between kernel launches, detokenizing) a ready stream write waits. ``LoopMonitor`` measures both
sides of that wait without touching the engine:

- ``gpuscope_event_loop_lag_seconds``: a task sleeps ``interval`` and records how much later than
  asked it woke (asyncio's own timer resolution, about 1 ms, is part of every sample);
- ``gpuscope_event_delivery_seconds``: each batch of engine events is stamped when the engine hands it
  to ``call_soon_threadsafe`` and observed when the loop runs it (``timed``).

One observation per sample or step, never per token: the cost is a histogram update.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue as c

INTERVAL_S = 0.025


class LoopMonitor:
    def __init__(self, registry: CollectorRegistry, interval: float = INTERVAL_S) -> None:
        self.lag = c.EVENT_LOOP_LAG.create(registry)
        self.delivery = c.EVENT_DELIVERY.create(registry)
        self.interval = interval
        self._task: asyncio.Task | None = None

    def timed(self, dispatch: Callable[[Any], None]) -> Callable[[Any, float], None]:
        """``dispatch`` for ``call_soon_threadsafe(fn, events, perf_counter())``: observes the wait."""
        observe = self.delivery.observe

        def run(events: Any, handed_at: float) -> None:
            observe(max(0.0, time.perf_counter() - handed_at))
            dispatch(events)

        return run

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        observe, interval = self.lag.observe, self.interval
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            observe(max(0.0, loop.time() - due))

    def start(self) -> None:
        """Start sampling on the running loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sample(), name="gpuscope-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
