"""A logging handler that ships records to Loki, without ever blocking the program that logs.

Two lines of set-up::

    from gpuscope.logs.loki_push import LokiHandler
    logging.getLogger().addHandler(LokiHandler("http://loki:3100", service="my-app"))

``emit`` formats the record and appends it to a bounded buffer (O(1); when the
buffer is full the record is dropped and counted). A sender thread pushes
batches (by size or every ``batch_interval`` seconds) to ``/loki/api/v1/push``
as gzip JSON, retrying failures with exponential backoff and jitter; Loki
being down costs the caller nothing but the records that overflow the buffer.
``close()`` (called by ``logging.shutdown`` at exit) flushes within
``flush_timeout`` seconds and counts what it could not send.

Streams carry only bounded labels (``service``, ``instance``); the level and
request fields such as ``trace_id`` and ``tenant`` (taken from the record's
attributes, e.g. ``log.info(msg, extra={"trace_id": tid})``) go in structured
metadata, the third element of each value (Loki 3.x, schema v13).

Self-metrics (names from ``gpuscope.contract.catalogue``): records sent, records dropped
by reason (queue_full, rejected, shutdown), failed pushes, and records waiting.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections import deque
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry

from gpuscope.contract import catalogue as c

PUSH_PATH = "/loki/api/v1/push"
DROP_REASONS = ("queue_full", "rejected", "shutdown")
_self_log = logging.getLogger("gpuscope.loki_push")

Entry = tuple[str, str, dict[str, str]]


class _Aggregate:
    """One collector per registry, summing every live handler registered in it."""

    #: Every family it yields.
    METRICS = (c.LOG_RECORDS_SENT, c.LOG_RECORDS_DROPPED, c.LOG_PUSH_FAILURES, c.LOG_QUEUE_RECORDS)

    def __init__(self) -> None:
        self.handlers: weakref.WeakSet[LokiHandler] = weakref.WeakSet()

    def describe(self):
        return [metric.family() for metric in self.METRICS]

    def collect(self):
        handlers = list(self.handlers)
        sent, dropped = c.LOG_RECORDS_SENT.family(), c.LOG_RECORDS_DROPPED.family()
        failures, queued = c.LOG_PUSH_FAILURES.family(), c.LOG_QUEUE_RECORDS.family()
        sent.add_metric([], sum(h.sent for h in handlers))
        failures.add_metric([], sum(h.push_failures for h in handlers))
        queued.add_metric([], sum(len(h._buffer) for h in handlers))
        for reason in DROP_REASONS:
            dropped.add_metric([reason], sum(h.dropped[reason] for h in handlers))
        return [sent, dropped, failures, queued]


_aggregates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_aggregates_lock = threading.Lock()


def _register(handler: LokiHandler, registry: CollectorRegistry) -> None:
    with _aggregates_lock:
        aggregate = _aggregates.get(registry)
        if aggregate is None:
            aggregate = _aggregates[registry] = _Aggregate()
            registry.register(aggregate)
        aggregate.handlers.add(handler)


def push_url(url: str) -> str:
    """``http://loki:3100`` → ``http://loki:3100/loki/api/v1/push`` (a full push URL is kept)."""
    url = url.rstrip("/")
    return url if url.endswith(PUSH_PATH) else url + PUSH_PATH


class LokiHandler(logging.Handler):
    """Batched, bounded, non-blocking Loki push handler (see the module docstring).

    Args:
        url: Loki base URL (``http://loki:3100``) or the full push URL.
        service, instance: the only stream labels (instance defaults to the host name).
        metadata: record attributes copied into structured metadata when present.
        batch_size: records per push; a full batch is pushed at once.
        batch_interval: seconds between pushes of partial batches.
        max_buffer: records held while Loki is slow or down; more are dropped and counted.
        timeout: seconds one push may take.
        backoff_initial, backoff_max: retry delays (doubling, with ±50% jitter).
        flush_timeout: seconds ``close()`` spends sending what is left.
        tenant_id: ``X-Scope-OrgID`` for a multi-tenant Loki.
        registry: where the self-metrics go (None: nowhere).
    """

    def __init__(self, url: str, *, service: str = "gpuscope", instance: str | None = None,
                 metadata: Iterable[str] = ("trace_id", "tenant", "fault"), batch_size: int = 500,
                 batch_interval: float = 1.0, max_buffer: int = 10_000, timeout: float = 5.0,
                 backoff_initial: float = 0.5, backoff_max: float = 30.0, flush_timeout: float = 5.0,
                 tenant_id: str | None = None, registry: CollectorRegistry | None = REGISTRY,
                 level: int = logging.NOTSET) -> None:
        super().__init__(level)
        if batch_size < 1 or max_buffer < 1 or batch_interval <= 0 or timeout <= 0:
            raise ValueError("batch_size and max_buffer must be >= 1; batch_interval and timeout > 0")
        self.url = push_url(url)
        self.labels = {"service": service, "instance": instance or socket.gethostname()}
        self.metadata = tuple(metadata)
        self.batch_size = batch_size
        self.batch_interval = batch_interval
        self.max_buffer = max_buffer
        self.timeout = timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.flush_timeout = flush_timeout
        self.headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if tenant_id:
            self.headers["X-Scope-OrgID"] = tenant_id
        self.sent = 0
        self.push_failures = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._drop_lock = threading.Lock()
        self._buffer: deque[Entry] = deque()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._outage_logged = False
        if registry is not None:
            _register(self, registry)
        self._thread = threading.Thread(target=self._run, name="gpuscope-loki", daemon=True)
        self._thread.start()

    # --- caller's thread -------------------------------------------------------------
    def handle(self, record: logging.LogRecord) -> bool:
        # Skip logging.Handler's lock: emit only appends to a deque, which is thread-safe.
        rv = self.filter(record)
        if rv:
            self.emit(record)
        return bool(rv)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == _self_log.name:
            return  # the sender's own complaints about Loki must not feed back into Loki
        try:
            if len(self._buffer) >= self.max_buffer or self._closing.is_set():
                self._drop("queue_full" if not self._closing.is_set() else "shutdown", 1)
                return
            meta = {"level": record.levelname.lower()}
            for key in self.metadata:
                value = getattr(record, key, None)
                if value is not None:
                    meta[key] = str(value)
            self._buffer.append((str(int(record.created * 1e9)), self.format(record), meta))
            if len(self._buffer) >= self.batch_size:
                self._wake.set()
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        """Ask the sender to push now (does not wait)."""
        self._wake.set()

    def close(self) -> None:
        """Send what is buffered within ``flush_timeout`` seconds, then stop; the rest is counted."""
        if not self._closing.is_set():
            self._deadline = time.monotonic() + self.flush_timeout
            self._closing.set()
            self._wake.set()
            self._thread.join(self.flush_timeout + 1.0)
        super().close()

    def _drop(self, reason: str, count: int) -> None:
        with self._drop_lock:
            self.dropped[reason] += count

    # --- sender thread ---------------------------------------------------------------
    def _take(self) -> list[Entry]:
        batch: list[Entry] = []
        while self._buffer and len(batch) < self.batch_size:
            batch.append(self._buffer.popleft())
        return batch

    def _run(self) -> None:
        backoff = self.backoff_initial
        pending: list[Entry] = []
        while True:
            closing = self._closing.is_set()
            if closing and time.monotonic() >= self._deadline:
                break
            if not pending:
                if not closing and len(self._buffer) < self.batch_size:
                    self._wake.wait(self.batch_interval)
                # Whatever asked for a push (a full batch, flush) is answered by the batch taken now:
                # a wake left set would push the remainder of a full batch early, as a partial one.
                self._wake.clear()
                pending = self._take()
                if not pending:
                    if self._closing.is_set() and not self._buffer:
                        break
                    continue
            result = self._push(pending)
            if result == "sent":
                self.sent += len(pending)
                pending, backoff = [], self.backoff_initial
                if self._outage_logged:
                    _self_log.warning("Loki push to %s works again", self.url)
                    self._outage_logged = False
            elif result == "rejected":
                self._drop("rejected", len(pending))
                pending = []
            else:
                self.push_failures += 1
                if not self._outage_logged:
                    _self_log.warning("Loki push to %s failed (%s); retrying with backoff", self.url, result)
                    self._outage_logged = True
                delay = min(self.backoff_max, backoff) * random.uniform(0.5, 1.5)
                backoff = min(self.backoff_max, backoff * 2)
                if self._closing.is_set():
                    time.sleep(min(delay, max(0.0, self._deadline - time.monotonic())))
                else:
                    self._closing.wait(delay)
        left = len(pending) + len(self._buffer)
        self._buffer.clear()
        if left:
            self._drop("shutdown", left)

    def _push(self, batch: list[Entry]) -> str:
        """"sent", "rejected" (a 4xx other than 429: retrying cannot help) or a failure reason."""
        body = {"streams": [{"stream": self.labels, "values": [list(entry) for entry in batch]}]}
        data = gzip.compress(json.dumps(body).encode(), compresslevel=5)
        request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
        timeout = self.timeout
        if self._closing.is_set():
            timeout = max(0.05, min(timeout, self._deadline - time.monotonic()))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
            return "sent"
        except urllib.error.HTTPError as exc:
            if exc.code == 429 or exc.code >= 500:
                return f"HTTP {exc.code}"
            _self_log.warning("Loki rejected %d records: HTTP %d %s", len(batch), exc.code,
                              exc.read(200).decode("utf-8", "replace"))
            return "rejected"
        except (OSError, ValueError) as exc:  # URLError, refused, timeout, reset
            return type(exc).__name__


__all__ = ["PUSH_PATH", "LokiHandler", "push_url"]
