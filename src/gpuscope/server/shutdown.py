"""Graceful shutdown on SIGTERM or SIGINT: stop admitting, let running requests finish within the
grace, end the rest cleanly, count each outcome.

On the signal (:meth:`Drain.run`):

1. new generation requests (``POST /v1/...``) get ``503`` with a JSON body and ``Retry-After``, and
   ``/readyz`` answers 503, so a load balancer or Kubernetes sends no more; ``/healthz`` and
   ``/metrics`` keep answering;
2. requests still queued (not started) end at once: a non-streaming one gets 503, a stream its
   error chunk and ``data: [DONE]``; they would only start after SIGTERM and be cut;
3. running requests go on for up to the grace (``--shutdown.grace``); a second signal ends the wait;
4. what still runs then is ended the same way (the engine stops and fails them with
   ``server shutting down``), its handler writes the error chunk and ``[DONE]``, and only then does
   the HTTP server close its connections and the engine and timer stop.

Each request that ends during the shutdown is counted once in
``gpuscope_shutdown_requests_total{outcome}``: ``rejected`` (503 at the door), ``completed``,
``failed`` (an engine error), ``disconnected`` (the client left), ``aborted_queued`` and
``aborted_running`` (ended by the shutdown before or after they started).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue as c

from .engine import SHUTDOWN_MESSAGE, Done, Failed
from .service import Service

log = logging.getLogger("gpuscope.server")

OUTCOMES = ("rejected", "completed", "failed", "disconnected", "aborted_queued", "aborted_running")
#: After the engine ended what was left: how long its handlers get to write their last chunk.
FINAL_WRITE_S = 2.0
#: How long exiting may take after the grace, at most: the engine's stop (5 s when a step hangs),
#: the last chunks (FINAL_WRITE_S), closing connections and flushing logs. An orchestrator's stop grace
#: (compose's stop_grace_period, Kubernetes' terminationGracePeriodSeconds) must be at least
#: ``--shutdown.grace`` plus this, or it kills the server mid-drain.
EXIT_AFTER_GRACE_S = 10.0

ErrorResponse = Callable[..., web.Response]


def is_generation(request: web.BaseRequest) -> bool:
    """A request that would run the model (completions, chat completions, any later ``POST /v1/...``)."""
    return request.method == "POST" and request.path.startswith("/v1/")


class Drain:
    """The server's shutdown state: an aiohttp middleware (``middleware``) that gates and counts
    requests, and ``run()`` for the signal. One per app; the event loop's thread only."""

    def __init__(self, service: Service, registry: CollectorRegistry, grace_s: float,
                 error_response: ErrorResponse) -> None:
        self.service = service
        self.grace_s = grace_s
        self.draining = False
        self._error_response = error_response
        self.outcomes = c.SHUTDOWN_REQUESTS.create(registry)
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)
        self.counts = dict.fromkeys(OUTCOMES, 0)  # the same counts, for the closing log line
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()

    @property
    def in_flight(self) -> int:
        """Generation requests whose handlers are running."""
        return self._in_flight

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if self.draining:
            if is_generation(request):
                self._count("rejected")
                retry = str(max(1, math.ceil(self.grace_s)))
                return self._error_response(503, "server is shutting down; send the request to another "
                                                 "replica or retry", "server_error",
                                            headers={"Retry-After": retry, "Connection": "close"})
            if request.path == "/readyz":
                return self._error_response(503, "server is shutting down", "server_error")
            return await handler(request)
        if not is_generation(request):
            return await handler(request)
        self._in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def hurry(self) -> None:
        """A second signal: end the grace now."""
        self._hurry.set()

    async def run(self) -> None:
        """Drain (steps 1–4 of the module's docstring); returns once no generation handler runs,
        or FINAL_WRITE_S after the engine ended what was left."""
        if self.draining:
            return
        self.draining = True
        engine = self.service.engine
        started = time.monotonic()
        self._observe(engine)
        log.info("shutting down: %d requests in flight, up to %gs to finish (a second signal ends the "
                 "wait)", self._in_flight, self.grace_s)
        engine.drain()
        await self._wait_idle(self.grace_s)
        if self._in_flight:
            log.info("shutting down: grace over, ending %d requests", self._in_flight)
            await asyncio.get_running_loop().run_in_executor(None, engine.stop, 5.0)
            self._hurry.clear()
            await self._wait_idle(FINAL_WRITE_S)
        log.info("shutdown drained in %.1fs: %s", time.monotonic() - started,
                 ", ".join(f"{o} {n}" for o, n in self.counts.items()))

    def _count(self, outcome: str) -> None:
        self.outcomes.labels(outcome).inc()
        self.counts[outcome] += 1

    async def _wait_idle(self, timeout: float) -> None:
        if self._idle.is_set():
            return
        idle = asyncio.ensure_future(self._idle.wait())
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait({idle, hurry}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            hurry.cancel()

    def _observe(self, engine) -> None:
        """Count how each request the engine ends from now on ended (on the engine's thread)."""
        deliver = engine._deliver

        def counting(events: list) -> None:
            for req, event in events:
                if isinstance(event, Done):
                    self._count("completed")
                elif isinstance(event, Failed):
                    if event.reason != "abort":
                        self._count("failed")
                    elif event.message != SHUTDOWN_MESSAGE:
                        self._count("disconnected")
                    else:
                        self._count("aborted_queued" if req.scheduled_at is None else "aborted_running")
            deliver(events)

        engine._deliver = counting
