"""The engine thread: dynamic batching, prefill and decode steps, continuous joining.

One dedicated thread owns the model (so the HTTP event loop stays responsive).
Each iteration it applies faults, drops cancelled requests, admits waiting
requests into free batch slots (or, under share scheduling, preempts a
lower-priority one), runs one batched prefill for the newcomers and one
batched decode step for everyone else, then hands the iteration's events to
``deliver`` in one call. With nothing running, a batch forms for at most
``max_wait_s`` before its prefill starts.

Each step is timed with ``timer.start(op, on_elapsed=...)``; its measured GPU
seconds are split among the step's tenants by token count and charged to the
scheduler, which is how shares follow GPU time rather than wall clock.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .faults import FaultInjector
from .metrics import RequestMetrics
from .model import EOS, StreamDecoder, TinyGPT, sample
from .scheduler import Scheduler
from .timer_glue import HostClock, trace_context

log = logging.getLogger("gpuscope.server")
request_log = logging.getLogger("gpuscope.server.requests")


@dataclass(frozen=True)
class Token:
    text: str


@dataclass(frozen=True)
class Done:
    reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    text_tail: str = ""


@dataclass(frozen=True)
class Failed:
    reason: str  # abort | error
    message: str


Event = Token | Done | Failed


@dataclass(eq=False)
class Request:
    """One completion request as the engine sees it. Times are ``time.perf_counter()`` seconds."""

    tenant: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    trace_id: str = ""
    arrival: float = field(default_factory=time.perf_counter)
    channel: Any = None  # the deliverer's handle for this request (an asyncio.Queue in the API)
    seq: int = 0
    cancelled: bool = False
    generated: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None
    decoder: StreamDecoder = field(default_factory=StreamDecoder)


Deliver = Callable[[list[tuple[Request, Event]]], None]


class Engine:
    def __init__(self, model: TinyGPT, scheduler: Scheduler, timer, *, batch_size: int,
                 max_wait_s: float, deliver: Deliver, metrics: RequestMetrics | None = None,
                 faults: FaultInjector | None = None, log_requests: bool = True,
                 on_step: Callable[[str, list[Request], float], Any] | None = None) -> None:
        self.model = model
        self.scheduler = scheduler
        self.timer = timer
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self.faults = faults
        self.log_requests = log_requests
        self.on_step = on_step  # observer (op, batch, host seconds incl. the sync), e.g. for benchmarks
        self._deliver = deliver
        self._device = next(model.parameters()).device
        self._context = model.spec.context
        # The host clock must read after the device sync; event timers record before it.
        self._stop_after_sync = isinstance(timer, HostClock)
        self._running: list[Request] = []
        self._free_slots = list(range(batch_size - 1, -1, -1))
        self._kv_usage = 0.0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        model.allocate_cache(batch_size)

    # --- any thread --------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue ``req``; raises ``scheduler.QueueFull`` when its tenant's queue is full."""
        self.scheduler.submit(req)
        self._wake.set()

    def cancel(self, req: Request) -> None:
        """The client went away: the request leaves the batch at the next step (outcome abort)."""
        req.cancelled = True
        self._wake.set()

    def kv_usage(self) -> float:
        return self._kv_usage

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuscope-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- engine thread -----------------------------------------------------------
    def _run(self) -> None:
        if self._device.type == "cuda":
            # A new thread starts on CUDA device 0; the timer records on the current device's
            # stream, so an engine on cuda:N must make N current or its steps are timed on GPU 0.
            torch.cuda.set_device(self._device)
        with torch.inference_mode():
            self._warm_up()
            self.ready.set()
            while not self._stopping:
                try:
                    self._iteration()
                except Exception as exc:  # a failed step fails its batch, never the server
                    log.exception("engine step failed")
                    events: list[tuple[Request, Event]] = []
                    for req in list(self._running):
                        self._finish(req, "error", events, f"engine step failed: {type(exc).__name__}")
                    self._send(events)
            events = []
            for req in list(self._running):
                self._finish(req, "abort", events, "server shutting down")
            for req in self.scheduler.pick(1 << 30):
                self._finish(req, "abort", events, "server shutting down")
            self._send(events)

    def _warm_up(self) -> None:
        slot = torch.zeros(1, dtype=torch.long, device=self._device)
        tokens = torch.zeros((1, 4), dtype=torch.long, device=self._device)
        self.model(tokens, slot, slot, slot + 3, 4).float().cpu()

    def _iteration(self) -> None:
        self._wake.clear()
        if self.faults is not None:
            self.faults.apply(self.model, self.scheduler)
        events: list[tuple[Request, Event]] = []
        for req in [r for r in self._running if r.cancelled]:
            self._finish(req, "abort", events, "client disconnected")
        if not self._running:
            count, oldest = self.scheduler.oldest_seq_age()
            if count == 0:
                self._send(events)
                self._wake.wait(0.1)
                return
            age = time.perf_counter() - (oldest or 0.0)
            if count < self.batch_size and age < self.max_wait_s:
                self._send(events)
                self._wake.wait(self.max_wait_s - age)
                return
        new = self._admit(events)
        old = [r for r in self._running if r not in new]
        if new:
            self._prefill(new, events)
        if old:
            self._decode(old, events)
        self._kv_usage = sum(r.cached for r in self._running) / (self.batch_size * self._context)
        self._send(events)

    def _admit(self, events: list) -> list[Request]:
        new: list[Request] = []
        for req in self.scheduler.pick(len(self._free_slots)):
            if req.cancelled:
                self._finish(req, "abort", events, "client disconnected", started=False)
            else:
                self._start(req, new, events)
        for _ in range(self.batch_size):
            if self._free_slots or not self.scheduler.waiting():
                break
            swap = self.scheduler.preempt([r for r in self._running if r not in new])
            if swap is None:
                break
            victim, req = swap
            self._running.remove(victim)
            self._free_slots.append(victim.slot)
            victim.slot, victim.cached = -1, 0
            if req.cancelled:
                self._finish(req, "abort", events, "client disconnected", started=False)
            else:
                self._start(req, new, events)
        return new

    def _start(self, req: Request, new: list[Request], events: list) -> None:
        now = time.perf_counter()
        if req.scheduled_at is None:
            req.scheduled_at = now
            if self.metrics:
                self.metrics.observe(self.metrics.queue, req.tenant, now - req.arrival, req.trace_id)
                self.metrics.prompt_tokens.labels(req.tenant).inc(len(req.prompt))
        error = self.faults.fail_request() if self.faults is not None else None
        req.slot = self._free_slots.pop()
        self._running.append(req)
        if error is not None:
            self._finish(req, "error", events, error)
            return
        new.append(req)

    def _step(self, op: str, batch: list[Request], tokens: torch.Tensor, start: list[int],
              last: list[int], span: int, weights: list[int]) -> list[int]:
        dev = self._device
        slots = torch.tensor([r.slot for r in batch], dtype=torch.long, device=dev)
        start_t = torch.tensor(start, dtype=torch.long, device=dev)
        last_t = torch.tensor(last, dtype=torch.long, device=dev)
        temps = torch.tensor([r.temperature for r in batch], dtype=torch.float32, device=dev)
        share: dict[str, int] = {}
        for req, weight in zip(batch, weights, strict=True):
            share[req.tenant] = share.get(req.tenant, 0) + weight
        began = time.perf_counter()
        with trace_context(batch[0].trace_id):
            estimate = self.scheduler.provisional(op, share)
            charge = functools.partial(self.scheduler.charge, share, op=op, estimate=estimate)
            handle = self.timer.start(op, on_elapsed=charge)
            next_tokens = sample(self.model(tokens, slots, start_t, last_t, span), temps)
            if self._stop_after_sync:
                ids = next_tokens.tolist()
                self.timer.stop(handle)
            else:
                self.timer.stop(handle)
                ids = next_tokens.tolist()
        if self.on_step is not None:
            self.on_step(op, batch, time.perf_counter() - began)
        if self.metrics:
            self.metrics.batch_size.labels("prefill" if op == "prefill" else "decode").observe(len(batch))
        return ids

    def _prefill(self, batch: list[Request], events: list) -> None:
        rows = [r.prompt + r.generated for r in batch]
        width = max(len(row) for row in rows)
        tokens = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        ids = self._step("prefill", batch, tokens.to(self._device), [0] * len(batch),
                         [len(row) - 1 for row in rows], width, [len(row) for row in rows])
        now = time.perf_counter()
        for req, row, token in zip(batch, rows, ids, strict=True):
            req.cached = len(row)
            self._emit(req, token, now, events)

    def _decode(self, batch: list[Request], events: list) -> None:
        tokens = torch.tensor([[r.generated[-1]] for r in batch], dtype=torch.long, device=self._device)
        start = [r.cached for r in batch]
        ids = self._step("decode", batch, tokens, start, [0] * len(batch), max(start) + 1, [1] * len(batch))
        now = time.perf_counter()
        for req, token in zip(batch, ids, strict=True):
            req.cached += 1
            self._emit(req, token, now, events)

    def _emit(self, req: Request, token: int, now: float, events: list) -> None:
        req.generated.append(token)
        m = self.metrics
        if req.first_token_at is None:
            req.first_token_at = now
            if m:
                m.observe(m.ttft, req.tenant, now - req.arrival, req.trace_id)
                m.observe(m.prefill, req.tenant, now - (req.scheduled_at or now), req.trace_id)
        elif m and req.last_token_at is not None:
            m.observe(m.itl, req.tenant, now - req.last_token_at, req.trace_id)
        req.last_token_at = now
        if m:
            m.generation_tokens.labels(req.tenant).inc()
        text = req.decoder.feed(token)
        if text:
            events.append((req, Token(text)))
        if token == EOS:
            self._finish(req, "stop", events)
        elif len(req.generated) >= req.max_tokens or req.cached + 1 >= self._context:
            self._finish(req, "length", events)

    def _finish(self, req: Request, outcome: str, events: list, message: str = "",
                started: bool = True) -> None:
        now = time.perf_counter()
        req.outcome, req.finished_at = outcome, now
        if req in self._running:
            self._running.remove(req)
            self._free_slots.append(req.slot)
            req.slot = -1
        if started:
            self.scheduler.finished(req)
        m = self.metrics
        if outcome in ("stop", "length"):
            events.append((req, Done(outcome, len(req.prompt), len(req.generated), req.decoder.finish())))
            if m and req.first_token_at is not None:
                m.observe(m.e2e, req.tenant, now - req.arrival, req.trace_id)
                m.observe(m.decode, req.tenant, now - req.first_token_at, req.trace_id)
                if len(req.generated) > 1:
                    tpot = (now - req.first_token_at) / (len(req.generated) - 1)
                    m.observe(m.tpot, req.tenant, tpot, req.trace_id)
        else:
            events.append((req, Failed(outcome, message)))
        if m:
            m.requests.labels(req.tenant, outcome).inc()
        if self.log_requests:
            self._log(req, outcome, message, now)

    def _log(self, req: Request, outcome: str, message: str, now: float) -> None:
        def span(a: float | None, b: float | None) -> float | None:
            return round(b - a, 6) if a is not None and b is not None else None

        line = {"event": "request", "trace_id": req.trace_id, "tenant": req.tenant, "outcome": outcome,
                "prompt_tokens": len(req.prompt), "completion_tokens": len(req.generated),
                "queue_s": span(req.arrival, req.scheduled_at),
                "ttft_s": span(req.arrival, req.first_token_at),
                "e2e_s": span(req.arrival, now)}
        if message:
            line["error"] = message
        level = logging.ERROR if outcome == "error" else logging.INFO
        request_log.log(level, json.dumps(line), extra={"trace_id": req.trace_id, "tenant": req.tenant})

    def _send(self, events: list) -> None:
        if not events:
            return
        try:
            self._deliver(events)
        except Exception:  # a closed loop at shutdown must not kill the engine
            log.exception("delivering %d events failed", len(events))
