"""The engine thread: dynamic batching, prefill and decode steps, continuous joining.

One dedicated thread owns the model (so the HTTP event loop stays responsive).
Each iteration it applies faults, drops cancelled requests, admits waiting
requests into free batch slots (or, under share scheduling, preempts a
lower-priority one), runs one batched prefill for the newcomers and one
batched decode step for everyone else, handing each step's events to ``deliver``
in one call (the prefill's before the decode step runs, so a newcomer's first
token does not wait for it). With nothing running, a batch forms for at most
``max_wait_s`` before its prefill starts.

Each step is timed with ``timer.start(op, on_elapsed=...)``; its measured GPU
seconds are split among the step's tenants by token count and charged to the
scheduler, which is how shares follow GPU time rather than wall clock.

The model is a ``ModelRunner`` (``model.py``): the toy ``TinyGPT`` (a bare
``TinyGPT`` is wrapped in ``TinyRunner``) or a Hugging Face causal LM
(``hf.py``). The engine knows slots, token ids and logits, never the model's
cache layout or tokenizer.
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
from .model import Decoder, ModelRunner, StreamDecoder, TinyGPT, TinyRunner, sample
from .scheduler import Scheduler
from .step_timing import HostClock, trace_context
from .stops import StopStrings

log = logging.getLogger("gpuscope.server")
request_log = logging.getLogger("gpuscope.server.requests")
#: The message of every request the server ends because it is shutting down (engine stop or drain).
SHUTDOWN_MESSAGE = "server shutting down"


@dataclass(frozen=True)
class Token:
    text: str


@dataclass(frozen=True)
class Done:
    reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    text_tail: str = ""
    stop_reason: str | None = None  # the stop string that ended the request (vLLM's stop_reason)


@dataclass(frozen=True)
class Failed:
    reason: str  # abort | error
    message: str


Event = Token | Done | Failed


@dataclass(eq=False)
class Request:
    """One completion request as the engine sees it. Times are ``time.perf_counter()`` seconds."""

    tenant: str
    prompt: list[int]  # the API's ids: BOS, then the prompt's UTF-8 bytes (model.encode)
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
    tokens: list[int] | None = None  # the prompt in the model's tokens, set when first scheduled
    decoder: Decoder = field(default_factory=StreamDecoder)
    ignore_eos: bool = False  # generate past end-of-sequence tokens, up to max_tokens (vLLM's parameter)
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one (never includes it)
    #: Whether the tokenizer adds its special tokens (BOS) to the prompt; a chat template writes its own.
    add_special_tokens: bool = True
    #: When the first non-empty text was sent to the client (set by the API: the TTFT a client sees).
    first_text_at: float | None = None
    stops: StopStrings | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.stop and self.stops is None:
            self.stops = StopStrings(self.stop)

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens if self.tokens is not None else self.prompt)


Deliver = Callable[[list[tuple[Request, Event]]], None]


class Engine:
    def __init__(self, model: ModelRunner | TinyGPT, scheduler: Scheduler, timer, *, batch_size: int,
                 max_wait_s: float, deliver: Deliver, metrics: RequestMetrics | None = None,
                 faults: FaultInjector | None = None, log_requests: bool = True,
                 on_step: Callable[[str, list[Request], float], Any] | None = None,
                 profile: Any = None) -> None:
        self.runner: ModelRunner = TinyRunner(model) if isinstance(model, TinyGPT) else model
        self.model = self.runner.module
        self.scheduler = scheduler
        self.timer = timer
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self.faults = faults
        self.log_requests = log_requests
        self.on_step = on_step  # observer (op, batch, host seconds incl. the sync), e.g. for benchmarks
        self.profile = profile  # profile.ProfileCapture: started and stopped between steps, here
        self._deliver = deliver
        self._device = self.runner.device
        self._context = self.runner.context
        self._eos = self.runner.eos_ids
        # The host clock must read after the device sync; event timers record before it.
        self._stop_after_sync = isinstance(timer, HostClock)
        self._running: list[Request] = []
        self._free_slots = list(range(batch_size - 1, -1, -1))
        self._kv_usage = 0.0
        self._wake = threading.Event()
        self._stopping = False
        self._draining = False
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.runner.allocate(batch_size)

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

    def drain(self) -> None:
        """Start no more requests: those queued end at the next step (abort, SHUTDOWN_MESSAGE);
        running ones go on until they finish or ``stop()``."""
        self._draining = True
        self._wake.set()

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
            self.runner.warm_up()
            if self.profile is not None:
                self.profile.warm_up()
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
                self._finish(req, "abort", events, SHUTDOWN_MESSAGE)
            for req in self.scheduler.take_all():
                self._finish(req, "abort", events, SHUTDOWN_MESSAGE, started=False)
            self._send(events)

    def _iteration(self) -> None:
        self._wake.clear()
        if self.faults is not None:
            self.faults.apply(self.runner, self.scheduler)
        if self.profile is not None:
            self.profile.tick()
        events: list[tuple[Request, Event]] = []
        for req in [r for r in self._running if r.cancelled]:
            self._finish(req, "abort", events, "client disconnected")
        if self._draining:  # shutting down: what has not started never will
            for req in self.scheduler.take_all():
                self._finish(req, "abort", events, SHUTDOWN_MESSAGE, started=False)
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
            if old:  # newcomers' first tokens go out now, not one decode step later
                self._send(events)
                events = []
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
            self._release(victim)
            victim.cached = 0
            if req.cancelled:
                self._finish(req, "abort", events, "client disconnected", started=False)
            else:
                self._start(req, new, events)
        return new

    def _start(self, req: Request, new: list[Request], events: list) -> None:
        now = time.perf_counter()
        error = None
        if req.scheduled_at is None:
            req.scheduled_at = now
            error = self._tokenize(req)
            if self.metrics:
                self.metrics.observe(self.metrics.queue, req.tenant, now - req.arrival, req.trace_id)
                self.metrics.prompt_tokens.labels(req.tenant).inc(req.prompt_tokens)
        if error is None and self.faults is not None:
            error = self.faults.fail_request()
        req.slot = self._free_slots.pop()
        self._running.append(req)
        if error is not None:
            self._finish(req, "error", events, error)
            return
        new.append(req)

    def _tokenize(self, req: Request) -> str | None:
        """Set the request's model tokens and detokenizer; the error to fail it with, if any."""
        try:
            if req.add_special_tokens:
                req.tokens = self.runner.tokenize(req.prompt)
            else:
                req.tokens = self.runner.tokenize(req.prompt, add_special_tokens=False)
        except ValueError as exc:
            req.tokens = []
            return f"cannot tokenize the prompt: {exc}"
        req.decoder = self.runner.new_decoder(req.tokens)
        if len(req.tokens) + req.max_tokens > self._context:
            # The API bounds the prompt in bytes (+ BOS); a model's tokenizer may still make more tokens.
            return (f"prompt is {len(req.tokens)} tokens and max_tokens is {req.max_tokens}; together they "
                    f"exceed the model's context of {self._context} tokens")
        return None

    def _release(self, req: Request) -> None:
        """Give ``req``'s slot back (to the engine and the runner's cache)."""
        self._free_slots.append(req.slot)
        self.runner.free(req.slot)
        req.slot = -1

    def _step(self, op: str, batch: list[Request], run: Callable[[], torch.Tensor],
              weights: list[int]) -> list[int]:
        temps = torch.tensor([r.temperature for r in batch], dtype=torch.float32, device=self._device)
        share: dict[str, int] = {}
        for req, weight in zip(batch, weights, strict=True):
            share[req.tenant] = share.get(req.tenant, 0) + weight
        began = time.perf_counter()
        with trace_context(batch[0].trace_id):
            estimate = self.scheduler.provisional(op, share)
            charge = functools.partial(self.scheduler.charge, share, op=op, estimate=estimate)
            handle = self.timer.start(op, on_elapsed=charge)
            next_tokens = sample(run(), temps)
            if self._stop_after_sync:
                ids = next_tokens.tolist()
                self.timer.stop(handle)
            else:
                self.timer.stop(handle)
                ids = next_tokens.tolist()
        if self.on_step is not None or self.profile is not None:
            seconds = time.perf_counter() - began
            if self.on_step is not None:
                self.on_step(op, batch, seconds)
            if self.profile is not None:
                self.profile.after_step(op, len(batch), seconds)
        if self.metrics:
            self.metrics.batch_size.labels("prefill" if op == "prefill" else "decode").observe(len(batch))
        return ids

    def _prefill(self, batch: list[Request], events: list) -> None:
        rows = [(r.tokens if r.tokens is not None else r.prompt) + r.generated for r in batch]
        slots = [r.slot for r in batch]
        weights = [len(row) for row in rows]
        ids = self._step("prefill", batch, lambda: self.runner.prefill(slots, rows), weights)
        now = time.perf_counter()
        for req, row, token in zip(batch, rows, ids, strict=True):
            req.cached = len(row)
            self._emit(req, token, now, events)

    def _decode(self, batch: list[Request], events: list) -> None:
        slots = [r.slot for r in batch]
        tokens = [r.generated[-1] for r in batch]
        positions = [r.cached for r in batch]
        ids = self._step("decode", batch, lambda: self.runner.decode(slots, tokens, positions),
                         [1] * len(batch))
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
                # Engine-side (vLLM's TTFT); the API observes the TTFT clients see when it sends text.
                m.observe(m.engine_ttft, req.tenant, now - req.arrival, req.trace_id)
                m.observe(m.prefill, req.tenant, now - (req.scheduled_at or now), req.trace_id)
        elif m and req.last_token_at is not None:
            m.observe(m.itl, req.tenant, now - req.last_token_at, req.trace_id)
        req.last_token_at = now
        if m:
            m.generation_tokens.labels(req.tenant).inc()
        text = req.decoder.feed(token)
        if req.stops is not None and text:
            text, matched = req.stops.feed(text)
            if matched is not None:
                if text:
                    events.append((req, Token(text)))
                self._finish(req, "stop", events, stop_reason=matched)
                return
        if text:
            events.append((req, Token(text)))
        if token in self._eos and not req.ignore_eos:
            self._finish(req, "stop", events)
        elif len(req.generated) >= req.max_tokens or req.cached + 1 >= self._context:
            self._finish(req, "length", events)

    def _tail(self, req: Request, outcome: str) -> tuple[str, str, str | None]:
        """(outcome, the text not yet sent, stop reason) of a request ending with ``outcome``."""
        tail = req.decoder.finish()
        if req.stops is None:
            return outcome, tail, None
        tail, matched = req.stops.feed(tail)
        if matched is not None:
            return "stop", tail, matched
        return outcome, tail + req.stops.flush(), None

    def _finish(self, req: Request, outcome: str, events: list, message: str = "",
                started: bool = True, stop_reason: str | None = None) -> None:
        tail = ""
        if outcome in ("stop", "length") and stop_reason is None:
            outcome, tail, stop_reason = self._tail(req, outcome)
        now = time.perf_counter()
        req.outcome, req.finished_at = outcome, now
        if req in self._running:
            self._running.remove(req)
            self._release(req)
        if started:
            self.scheduler.finished(req)
        m = self.metrics
        if outcome in ("stop", "length"):
            events.append((req, Done(outcome, req.prompt_tokens, len(req.generated), tail, stop_reason)))
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
                "prompt_tokens": req.prompt_tokens, "completion_tokens": len(req.generated),
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
