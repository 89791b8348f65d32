"""OpenTelemetry spans for the server's requests: one trace per request, built after it ends.

``gpuscope serve --tracing.endpoint URL`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``) turns it on; without
it the API never imports this module. One trace per request::

    POST /v1/completions     (server span: the HTTP request, tenant, tokens, outcome, TTFT, GPU seconds;
                              POST /v1/chat/completions for chat, gen_ai.operation.name "chat")
    ├── queue                (arrival → first scheduled)
    ├── prefill              (scheduled → first token; its step events)
    ├── decode               (first token → last token; step events, then a summary)
    └── stream               (SSE only: headers sent → end of stream; time spent waiting on the client)

What it costs, and where:

- the HTTP handler starts the server span when the request arrives (that makes the sampling
  decision and the span id the response's ``traceparent`` names) and, when the response is done,
  appends the request to a bounded backlog. No other span is built on the event loop;
- the engine thread, after each model step, appends (step, share) to each traced request of the
  batch (through the engine's ``on_step`` observer), and the step's timer callback also stores the
  measured seconds on the step: the engine records nothing per request, so this is where rows,
  preemptions and GPU seconds per request come from;
- a builder thread turns finished requests into spans with explicit timestamps taken from what the
  engine already records (arrival, scheduled, first token, finished) and from the steps, once the
  timer has measured the request's steps (or ``GPU_WAIT_S`` after the response), and hands them to the
  SDK's BatchSpanProcessor, whose worker exports them over OTLP/HTTP.

Nothing here waits on the exporter. A full backlog or a full export queue drops the whole trace of a
request (never part of one) and a failed export drops its batch; all three are counted in
``gpuscope_trace_spans_dropped_total{reason}``. Trace ids are the ones the request's Loki line and
exemplars carry: the handler takes the request's trace id from its server span.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue as c
from gpuscope.contract import parts
from gpuscope.contract.spans import OUTCOME, TENANT, TTFT_MS
from gpuscope.util.logsafe import quote

from .config import ServerConfig, TimingMode
from .protocol import parse_traceparent
from .tracestate import valid_tracestate

log = logging.getLogger("gpuscope.server.tracing")

#: Resource ``service.name`` unless OTEL_SERVICE_NAME says otherwise: the ``service`` label of the
#: server's Loki stream, so a trace and its logs share the name.
SERVICE_NAME = parts.SERVER.service
ROOT_SPAN = "POST /v1/completions"
#: The generation routes and their GenAI operation names (OpenTelemetry's gen_ai.operation.name).
OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat"}
#: How long the builder waits, after a response, for the timer to measure the request's last steps.
GPU_WAIT_S = 1.0
#: Finished requests waiting to become spans; beyond it a request's trace is dropped (backlog_full).
BACKLOG = 4096
_POLL_S = 0.05
DROP_REASONS = ("backlog_full", "queue_full", "export_failed")

# Span attributes. GenAI and HTTP semantic-convention names where one fits; the server's own under
# ``gpuscope.``. TENANT, OUTCOME and TTFT_MS, which others read, are the contract's (imported above).
PRIORITY = "gpuscope.priority"
STREAM = "gpuscope.stream"
QUEUE_MS = "gpuscope.queue_ms"  # arrival → scheduled, whole ms rounded up
WAITING = "gpuscope.queue.waiting_at_arrival"  # requests queued (all tenants) when it was submitted
PREEMPTIONS = "gpuscope.preemptions"
STEPS = "gpuscope.steps"
ROWS_MAX = "gpuscope.batch_rows.max"
ROWS_MEAN = "gpuscope.batch_rows.mean"
STEP_HOST_MAX = "gpuscope.step_host_seconds.max"
GPU_SECONDS = "gpuscope.gpu_seconds"  # its token share of its steps' measured seconds
STEP_GPU_SECONDS = "gpuscope.step_gpu_seconds"  # the steps' whole measured seconds: what it waited on
UNRESOLVED = "gpuscope.gpu_seconds.unresolved_steps"
STEP_CLOCK = "gpuscope.step_clock"  # cuda_events, or host (CPU, or --timing off: host clock over the step)
STREAM_CHUNKS = "gpuscope.stream.chunks"
STREAM_WAIT = "gpuscope.stream.write_wait_seconds"


class _Step:
    """One engine step as the traced requests in it see it; ``gpu_s`` arrives from the timer."""

    __slots__ = ("end", "gpu_s", "host_s", "op", "rows", "timed")

    def __init__(self, op: str, timed: bool) -> None:
        self.op = op
        self.timed = timed  # a measurement will arrive (the engine passed on_elapsed)
        self.gpu_s: float | None = None
        self.end = 0.0
        self.host_s = 0.0
        self.rows = 0


class _StepTimer:
    """The engine's step timer, seen through: each step's measured seconds also land on its ``_Step``.

    The engine calls ``start(op, on_elapsed=...)`` then, after the step, ``on_step(op, batch, ...)``, on
    its own thread; ``take`` pairs the two. Everything else goes to the wrapped timer.
    """

    def __init__(self, timer: Any) -> None:
        self.wrapped = timer
        self._pending: _Step | None = None

    def start(self, op: str, on_elapsed: Callable[[float], Any] | None = None):
        if on_elapsed is None:
            self._pending = None
            return self.wrapped.start(op)
        step = self._pending = _Step(op, True)

        def elapsed(seconds: float) -> None:
            step.gpu_s = seconds
            on_elapsed(seconds)

        return self.wrapped.start(op, on_elapsed=elapsed)

    def stop(self, handle) -> None:
        self.wrapped.stop(handle)

    def take(self, op: str) -> _Step | None:
        step, self._pending = self._pending, None
        return step if step is not None and step.op == op else None

    def __getattr__(self, name: str):
        return getattr(self.wrapped, name)


class RequestTrace:
    """One request's span state, from arrival to the builder. The API reads ``trace_id``/``traceparent``."""

    __slots__ = ("chunks", "disconnected", "end", "error", "ns0", "perf0", "preemptions", "priority",
                 "recording", "req", "resolved", "span", "status", "steps", "stream_end", "stream_start",
                 "stream_wait", "tenant", "trace_id", "traceparent", "waiting")

    def __init__(self, span, ns0: int, perf0: float) -> None:
        self.span = span
        self.ns0, self.perf0 = ns0, perf0
        ctx = span.get_span_context()
        self.recording = span.is_recording()
        self.trace_id = format(ctx.trace_id, "032x")
        self.traceparent = f"00-{self.trace_id}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        self.req: Any = None
        self.tenant = ""
        self.priority = ""
        self.waiting: int | None = None
        self.steps: list[tuple[_Step, float]] = []
        self.resolved = 0
        self.preemptions = 0
        self.status: int | None = None
        self.end = 0.0
        self.error = ""
        self.stream_start: float | None = None
        self.stream_end: float | None = None
        self.stream_wait = 0.0
        self.chunks = 0
        self.disconnected = False

    def ns(self, perf: float) -> int:
        """A ``time.perf_counter()`` reading of this request → Unix nanoseconds."""
        return self.ns0 + int((perf - self.perf0) * 1e9)

    def timed(self, write: Callable[[bytes], Awaitable[None]]) -> Callable[[bytes], Awaitable[None]]:
        """``write`` (a stream's), also summing the time spent waiting for the client to take the bytes."""

        async def timed_write(data: bytes) -> None:
            began = time.perf_counter()
            try:
                await write(data)
            finally:
                self.stream_wait += time.perf_counter() - began
                self.chunks += 1

        return timed_write


class _CountingExporter(SpanExporter):
    """The real exporter, counting spans accepted and spans in failed batches."""

    def __init__(self, inner: SpanExporter, exported, dropped) -> None:
        self._inner = inner
        self._exported = exported
        self._dropped = dropped
        self._warned = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:  # an exporter bug must not kill the processor's worker
            log.debug("span exporter raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            if self._exported is not None:
                self._exported.inc(len(spans))
        else:
            if self._dropped is not None:
                self._dropped.labels("export_failed").inc(len(spans))
            if not self._warned:
                self._warned = True
                log.warning("exporting %d spans failed; further failures are only counted "
                            "(gpuscope_trace_spans_dropped_total{reason=\"export_failed\"})", len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _prompt(req) -> list[int]:
    """The request's prompt in the model's tokens once scheduled (the API's byte ids before)."""
    tokens = getattr(req, "tokens", None)
    return tokens if tokens is not None else req.prompt


def _ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000 - 1e-9))


class RequestTracing:
    """Spans for ``gpuscope serve``'s requests. ``attach(service)`` before the engine starts."""

    def __init__(self, config: ServerConfig, registry: CollectorRegistry | None = None, *,
                 exporter: SpanExporter | None = None, max_queue_size: int | None = None,
                 schedule_delay_millis: float | None = None, max_export_batch_size: int | None = None,
                 gpu_wait_s: float = GPU_WAIT_S, backlog: int = BACKLOG) -> None:
        self.config = config
        self._max_events = config.tracing_max_step_events
        self._gpu_wait_s = gpu_wait_s
        self._backlog_max = backlog
        self.exported = c.TRACE_SPANS_EXPORTED.create(registry) if registry is not None else None
        self.dropped = c.TRACE_SPANS_DROPPED.create(registry) if registry is not None else None
        if self.dropped is not None:
            for reason in DROP_REASONS:
                self.dropped.labels(reason)
        self.ignored = c.TRACE_CONTEXT_IGNORED.create(registry) if registry is not None else None
        if self.ignored is not None:
            for header in ("traceparent", "tracestate"):
                self.ignored.labels(header)
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over these defaults.
        defaults = {"service.name": SERVICE_NAME}
        if config.instance:
            defaults["service.instance.id"] = config.instance
        resource = Resource.create(defaults).merge(OTELResourceDetector().detect())
        ratio = config.tracing_sample_ratio
        # No ratio: the SDK reads OTEL_TRACES_SAMPLER(_ARG), else parent-based always-on.
        sampler = None if ratio is None else ParentBased(TraceIdRatioBased(ratio))
        self.provider = TracerProvider(resource=resource, sampler=sampler, shutdown_on_exit=False)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.tracing_endpoint)
        # Sizes and delay: the arguments, else OTEL_BSP_* , else the SDK's defaults (2048 spans, 5 s).
        self.processor = BatchSpanProcessor(_CountingExporter(exporter, self.exported, self.dropped),
                                            max_queue_size=max_queue_size,
                                            schedule_delay_millis=schedule_delay_millis,
                                            max_export_batch_size=max_export_batch_size)
        self.provider.add_span_processor(self.processor)
        # The processor's own queue (a bounded deque), read to admit whole traces only while they fit: the
        # SDK drops silently when it is full. Absent in another SDK version: then nothing is counted there.
        inner = getattr(self.processor, "_batch_processor", None)
        self._queue = getattr(inner, "_queue", None)
        self._queue_max = getattr(inner, "_max_queue_size", None)
        if self._queue is None or self._queue_max is None:
            self._queue = None
            log.warning("this opentelemetry-sdk hides its span queue: what it drops when full is not counted")
        self._tracer = self.provider.get_tracer("gpuscope.server")
        self._propagator = TraceContextTextMapPropagator()
        self._root_attributes = {
            route: {"http.request.method": "POST", "http.route": route, "url.path": route,
                    "url.scheme": "http", "gen_ai.operation.name": operation,
                    "gen_ai.request.model": config.model_name}
            for route, operation in OPERATIONS.items()}
        self._live: dict[Any, RequestTrace] = {}  # engine Request → its trace, while the engine may step it
        self._backlog: deque[RequestTrace] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._engine: Any = None
        self._timer: _StepTimer | None = None
        self._chain: Callable | None = None
        self._scheduler: Any = None
        self._step_clock = "host"
        self._failures = 0
        self._builder = threading.Thread(target=self._run, name="gpuscope-tracing", daemon=True)
        self._builder.start()

    # --- wiring ------------------------------------------------------------------------------
    def attach(self, service) -> None:
        """Observe ``service``'s engine steps (its ``on_step`` and step timer); before it starts."""
        engine = self._engine = service.engine
        self._scheduler = service.scheduler
        self._chain = engine.on_step
        engine.on_step = self._on_step
        self._timer = _StepTimer(engine.timer)
        engine.timer = self._timer
        device = getattr(service, "device", None)
        cuda = getattr(device, "type", "") == "cuda"
        self._step_clock = "cuda_events" if cuda and service.config.timing != TimingMode.OFF else "host"

    def detach(self) -> None:
        engine = self._engine
        if engine is None:
            return
        if engine.on_step == self._on_step:
            engine.on_step = self._chain
        if engine.timer is self._timer and self._timer is not None:
            engine.timer = self._timer.wrapped
        self._engine = None

    # --- the event loop ----------------------------------------------------------------------
    def begin(self, headers: Mapping[str, str], route: str = "/v1/completions") -> RequestTrace:
        """Start the request's server span (a child of a valid incoming ``traceparent``); ``route`` is
        one of ``OPERATIONS`` and names the span (``POST /v1/chat/completions``)."""
        ns0, perf0 = time.time_ns(), time.perf_counter()
        context = None
        header = headers.get("traceparent")
        if header and parse_traceparent(header) is None:
            self._ignore("traceparent", header)  # a new trace, as protocol.parse_traceparent decides
        elif header:
            # Stripped as protocol.parse_traceparent reads it, so both accept the same headers.
            carrier = {"traceparent": header.strip()}
            getall = getattr(headers, "getall", None)
            fields = getall("tracestate", []) if getall is not None else [headers.get("tracestate") or ""]
            state = ",".join(fields)
            if state.strip(" \t,"):
                if valid_tracestate(state):
                    carrier["tracestate"] = state
                else:  # dropped whole (W3C); never handed to OpenTelemetry, which logs it raw
                    self._ignore("tracestate", state)
            context = self._propagator.extract(carrier)
        span = self._tracer.start_span(f"POST {route}", context=context, kind=SpanKind.SERVER,
                                       start_time=ns0, attributes=self._root_attributes[route])
        return RequestTrace(span, ns0, perf0)

    def _ignore(self, header: str, value: str) -> None:
        """Count an invalid trace context header; the client's text only escaped and cut short."""
        if self.ignored is not None:
            self.ignored.labels(header).inc()
        log.debug("ignoring an invalid %s header: %s", header, quote(value, 64))

    def track(self, rt: RequestTrace, req, tenant: str) -> None:
        """``req`` is the engine request of ``rt``; call before submitting it, so its steps are seen."""
        rt.req, rt.tenant = req, tenant
        if not rt.recording:
            return
        spec = self.config.tenant(tenant)
        rt.priority = spec.priority if spec is not None else ""
        if self._scheduler is not None:
            rt.waiting = self._scheduler.waiting()
        self._live[req] = rt

    def end(self, rt: RequestTrace, status: int | None) -> None:
        """The response is done (``status`` None: the handler ended without one). O(1); builds nothing."""
        if not rt.recording:
            return
        rt.status, rt.end = status, time.perf_counter()
        if self._closing or len(self._backlog) >= self._backlog_max:
            self._live.pop(rt.req, None)
            self._drop("backlog_full", 1 + len(self._children(rt)))
            return
        self._backlog.append(rt)
        self._wake.set()

    # --- the engine thread -------------------------------------------------------------------
    def _on_step(self, op: str, batch: list, host_s: float) -> None:
        try:
            self._record_step(op, batch, host_s)
        except Exception:  # never let tracing fail the engine's step
            self._failed("recording a step")
        chain = self._chain
        if chain is not None:
            chain(op, batch, host_s)

    def _record_step(self, op: str, batch: list, host_s: float) -> None:
        now = time.perf_counter()
        step = self._timer.take(op) if self._timer is not None else None
        live = self._live
        traced = [(i, rt) for i, req in enumerate(batch) if (rt := live.get(req)) is not None]
        if not traced:
            return
        if step is None:
            step = _Step(op, False)
        step.end, step.host_s, step.rows = now, host_s, len(batch)
        if op == "prefill":
            # Shares as the engine charges tenants: prefill by the row's tokens, decode one each.
            weights = [len(_prompt(r)) + len(r.generated) for r in batch]
            total = sum(weights) or 1
            for i, rt in traced:
                if batch[i].generated:  # prefilled again with tokens already out: it was preempted
                    rt.preemptions += 1
                rt.steps.append((step, weights[i] / total))
        else:
            share = 1.0 / len(batch)
            for _, rt in traced:
                rt.steps.append((step, share))

    # --- the builder thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(_POLL_S if self._backlog else None)
            self._wake.clear()
            closing = self._closing
            now = time.perf_counter()
            for _ in range(len(self._backlog)):
                rt = self._backlog.popleft()
                if not (closing or self._ready(rt, now)):
                    self._backlog.append(rt)
                    continue
                try:
                    self._emit(rt)
                except Exception:
                    self._failed("building spans")
                finally:
                    self._live.pop(rt.req, None)
            if closing and not self._backlog:
                return

    def _ready(self, rt: RequestTrace, now: float) -> bool:
        """The engine is done with the request and the timer has measured its steps (or waited enough)."""
        if now - rt.end >= self._gpu_wait_s:
            return True
        req = rt.req
        if req is not None and req.scheduled_at is not None and req.finished_at is None:
            return False  # the client left; the engine drops the request at its next step
        steps, i = rt.steps, rt.resolved
        while i < len(steps) and (steps[i][0].gpu_s is not None or not steps[i][0].timed):
            i += 1
        rt.resolved = i
        return i == len(steps)

    def _children(self, rt: RequestTrace) -> list[tuple]:
        """(name, start, end, attributes, events, error) of each child span, times in perf seconds."""
        # Tenant, tokens, outcome: on the server span only (each attribute costs CPU to build and encode).
        req, children = rt.req, []
        if req is not None and not (rt.status == 429 and req.scheduled_at is None):  # 429: never queued
            done = req.finished_at if req.finished_at is not None else rt.end
            scheduled, first = req.scheduled_at, req.first_token_at
            queue = {}
            if rt.waiting is not None:
                queue[WAITING] = rt.waiting
            queued_until = scheduled if scheduled is not None else done
            children.append(("queue", req.arrival, queued_until, queue, [], ""))
            if scheduled is not None:
                cut = first if first is not None else done
                early = [s for s in rt.steps if s[0].end <= cut]
                late = rt.steps[len(early):]
                prefill_events, decode_events = self._step_events(rt, early, late)
                error = rt.error if first is None and req.outcome == "error" else ""
                children.append(("prefill", scheduled, cut, self._summary(early), prefill_events, error))
                if first is not None and (late or done > first):
                    error = rt.error if req.outcome == "error" else ""
                    children.append(("decode", first, max(first, done), self._summary(late),
                                     decode_events, error))
        if rt.stream_start is not None:
            attributes = {STREAM_CHUNKS: rt.chunks, STREAM_WAIT: round(rt.stream_wait, 6)}
            end = rt.stream_end if rt.stream_end is not None else rt.end
            children.append(("stream", rt.stream_start, end, attributes, [],
                             "client disconnected" if rt.disconnected else ""))
        return children

    def _step_events(self, rt: RequestTrace, early: list, late: list) -> tuple[list, list]:
        """Step events of the prefill and decode spans: at most N, then one summary event.

        With more steps than N: the first N/2 (the prefill and the first decodes, what TTFT is made of)
        and the N/2 slowest of the rest (where a long generation lost its time), in time order.
        """
        steps, limit, events = rt.steps, self._max_events, ([], [])
        shown = range(len(steps))
        if len(steps) > limit:
            head = (limit + 1) // 2
            slowest = sorted(range(head, len(steps)), key=lambda n: steps[n][0].host_s)[len(steps) - limit:]
            shown = [*range(head), *sorted(slowest)]
        shown = set(shown)
        previous_end = None
        for n, (step, _share) in enumerate(steps):
            phase = 0 if n < len(early) else 1
            if step.op == "prefill" and phase == 1 and previous_end is not None:
                # A prefill after the first token: the request was preempted and is recomputed.
                waited = max(0.0, step.end - step.host_s - previous_end)
                events[1].append(("resumed", step.end - step.host_s,
                                  {"gpuscope.preempted_ms": round(waited * 1e3, 3)}))
            previous_end = step.end
            if n not in shown:
                continue
            attributes = {"gpuscope.step.index": n, "gpuscope.step.op": step.op,
                          "gpuscope.step.rows": step.rows,
                          "gpuscope.step.host_ms": round(step.host_s * 1e3, 3)}
            if step.gpu_s is not None:
                attributes["gpuscope.step.gpu_ms"] = round(step.gpu_s * 1e3, 3)
            events[phase].append(("step", step.end, attributes))
        if len(steps) > limit:
            summary = {STEPS: len(steps), "gpuscope.steps.events_omitted": len(steps) - limit,
                       **self._summary(steps)}
            events[1 if late else 0].append(("steps.summary", steps[-1][0].end, summary))
        return events

    def _summary(self, steps: list[tuple[_Step, float]]) -> dict:
        if not steps:
            return {STEPS: 0}
        rows = [s.rows for s, _ in steps]
        measured = [(s.gpu_s, share) for s, share in steps if s.gpu_s is not None]
        summary = {STEPS: len(steps), ROWS_MAX: max(rows), ROWS_MEAN: round(sum(rows) / len(rows), 2),
                   STEP_HOST_MAX: round(max(s.host_s for s, _ in steps), 6)}
        if measured:
            summary[GPU_SECONDS] = round(sum(g * share for g, share in measured), 9)
            summary[STEP_GPU_SECONDS] = round(sum(g for g, _ in measured), 9)
        return summary

    def _emit(self, rt: RequestTrace) -> None:
        children = self._children(rt)
        count = 1 + len(children)
        queue = self._queue
        if queue is not None and self._queue_max - len(queue) < count:
            self._drop("queue_full", count)  # the whole trace, never part of one
            return
        context = set_span_in_context(rt.span)
        for name, start, end, attributes, events, error in children:
            span = self._tracer.start_span(name, context=context, start_time=rt.ns(start),
                                           attributes=attributes)
            for event, at, event_attributes in events:
                span.add_event(event, event_attributes, timestamp=rt.ns(at))
            if error:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end(end_time=rt.ns(max(start, end)))
        root = rt.span
        root.set_attributes(self._root_summary(rt))
        error = self._root_error(rt)
        if error:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=rt.ns(rt.end))

    def _outcome(self, rt: RequestTrace) -> str:
        req, status = rt.req, rt.status
        if req is not None and req.outcome is not None:
            return req.outcome
        if status == 429:
            return "rejected"
        if status is not None and 400 <= status < 500:
            return "invalid"
        if status is not None and status >= 500:
            return "error"
        return "abort" if req is not None else "invalid"

    def _root_summary(self, rt: RequestTrace) -> dict:
        req, outcome = rt.req, self._outcome(rt)
        attributes: dict[str, Any] = {OUTCOME: outcome, STREAM: rt.stream_start is not None,
                                      STEP_CLOCK: self._step_clock}
        if rt.status is not None:
            attributes["http.response.status_code"] = rt.status
            if rt.status >= 500:
                attributes["error.type"] = str(rt.status)
        if rt.tenant:
            attributes[TENANT] = rt.tenant
        if rt.priority:
            attributes[PRIORITY] = rt.priority
        if req is None:
            return attributes
        attributes.update({
            "gen_ai.request.max_tokens": req.max_tokens, "gen_ai.request.temperature": req.temperature,
            "gen_ai.usage.input_tokens": len(_prompt(req)),
            "gen_ai.usage.output_tokens": len(req.generated), PREEMPTIONS: rt.preemptions})
        if outcome in ("stop", "length"):
            attributes["gen_ai.response.finish_reasons"] = [outcome]
        if outcome == "error" and "error.type" not in attributes:
            attributes["error.type"] = "engine_error"
        if req.scheduled_at is not None:
            attributes[QUEUE_MS] = _ms(req.scheduled_at - req.arrival)
        # TTFT as the client saw it (the engine's when no text was sent)
        first = req.first_text_at if req.first_text_at is not None else req.first_token_at
        if first is not None:
            attributes[TTFT_MS] = _ms(first - req.arrival)
        summary = self._summary(rt.steps)
        attributes[STEPS] = summary[STEPS]
        for key in (GPU_SECONDS, STEP_GPU_SECONDS):
            if key in summary:
                attributes[key] = summary[key]
        unresolved = sum(1 for s, _ in rt.steps if s.timed and s.gpu_s is None)
        if unresolved:
            attributes[UNRESOLVED] = unresolved
        return attributes

    def _root_error(self, rt: RequestTrace) -> str:
        if rt.status is not None and rt.status >= 500:
            return rt.error or f"HTTP {rt.status}"
        if self._outcome(rt) == "error":
            return rt.error or "engine error"
        return ""

    # --- accounting and shutdown -------------------------------------------------------------
    def _drop(self, reason: str, spans: int) -> None:
        if self.dropped is not None:
            self.dropped.labels(reason).inc(spans)

    def _failed(self, what: str) -> None:
        self._failures += 1
        if self._failures == 1:
            log.exception("tracing failed while %s (further failures are not logged)", what)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every finished request's spans are built and exported; False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._backlog and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._backlog:
            return False
        return _run_with_timeout(self.processor.force_flush, deadline - time.monotonic())

    def close(self, timeout: float = 5.0) -> None:
        """Build what is left, export it within ``timeout`` (a dead endpoint costs all of it), stop."""
        deadline = time.monotonic() + timeout
        self.detach()
        self._closing = True
        self._wake.set()
        self._builder.join(max(0.0, deadline - time.monotonic()))
        if not _run_with_timeout(self.provider.shutdown, deadline - time.monotonic()):
            log.warning("tracing: spans still unexported after %.1fs at shutdown; leaving them", timeout)


def _run_with_timeout(call: Callable[[], Any], timeout: float) -> bool:
    """Run ``call`` on a daemon thread; True when it returned within ``timeout``."""
    done = threading.Event()

    def target() -> None:
        try:
            call()
        finally:
            done.set()

    threading.Thread(target=target, name="gpuscope-tracing-flush", daemon=True).start()
    return done.wait(max(0.0, timeout))


async def close_async(tracing: RequestTracing, timeout: float = 5.0) -> None:
    """``tracing.close`` off the event loop (it joins threads and may wait on the exporter)."""
    await asyncio.get_running_loop().run_in_executor(None, tracing.close, timeout)
