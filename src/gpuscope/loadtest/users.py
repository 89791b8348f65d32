"""The streaming completions user, and one weighted user class per tenant.

Users send requests back to back (a closed loop), pausing briefly only after a failure.

Why ``FastHttpUser``: on the 2-core machines this runs on, Locust shares the CPU
with the server it loads, and FastHttpUser costs about a quarter of HttpUser per
request. Its ``iter_content(n)`` waits until ``n`` bytes arrived, which would
hold back the first token and merge gaps, so lines are read with the underlying
geventhttpclient response's ``readline``, which returns as soon as one SSE line
is complete (``tests/loadtest`` checks this against a server that pauses
between tokens).

Requests carry what vLLM's OpenAI server reads (``model``, ``prompt``,
``max_tokens``, ``temperature``, ``stream``, ``stream_options.include_usage``,
``ignore_eos``: see :meth:`Workload.request_body`). Without ``--model`` a user
asks its host's ``GET /v1/models`` for the first model, once per process; a host
without that route gets requests without ``model`` (gpuscope serve needs none).

Each request shows up in Locust as these entries:

=====================  =====  =====================================================
``end_to_end``         POST   send → last byte; failures here; size = output tokens
``time_to_first_token`` SSE   send → first content chunk
``inter_token_latency`` SSE   every gap between content chunks
``output_tokens``      SSE    one per token, time 0: its RPS column is tokens/s
=====================  =====  =====================================================
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, ClassVar

from gevent import GreenletExit
from gevent.lock import Semaphore
from locust import FastHttpUser, task

from gpuscope.loadtest.options import Workload, tenant_class_name, user_seed
from gpuscope.loadtest.sse import DONE, Chunk, StreamError, StreamTiming, parse_sse_line
from gpuscope.loadtest.targets import TargetError, auth_headers, list_models

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
TENANT_HEADER = "X-Tenant"
log = logging.getLogger("gpuscope.loadtest")

#: Model each host serves, asked once per process ("" where the host lists none).
_served_models: dict[str, str] = {}
_served_models_lock = Semaphore()


def served_model(host: str) -> str:
    """The first model ``host`` lists at ``GET /v1/models``; "" (and one warning) when it cannot say."""
    with _served_models_lock:  # the first user asks; the others wait for its answer
        if host not in _served_models:
            try:
                _served_models[host] = list_models(host)[0]
                log.info("gpuscope: %s serves %r; requests name it", host, _served_models[host])
            except TargetError as exc:
                log.warning("gpuscope: %s; requests are sent without 'model' (set --model)", exc)
                _served_models[host] = ""
        return _served_models[host]


class CompletionsUser(FastHttpUser):
    """Sends streaming completions back to back (a closed loop: concurrency = users)."""

    abstract = True
    #: Tenant name sent in ``X-Tenant``.
    tenant: ClassVar[str] = "default"
    #: Pause after a failed request: failures come back in milliseconds, and a closed loop without
    #: a pause would turn an error burst into a flood that starves the server's machine of CPU.
    pause_after_failure_s: ClassVar[float] = 0.2
    # A long generation on a slow CPU server can take minutes; a connect should not.
    network_timeout = 300.0
    connection_timeout = 10.0
    _started_per_process: ClassVar[int] = 0
    _last_failed = False

    def wait_time(self) -> float:
        return self.pause_after_failure_s if self._last_failed else 0.0

    def on_start(self) -> None:
        CompletionsUser._started_per_process += 1
        process = getattr(self.environment.runner, "worker_index", 0) or 0
        self.workload = Workload.from_options(self.environment.parsed_options)
        self.rng = random.Random(user_seed(self.workload.seed, process, CompletionsUser._started_per_process))
        self.model = self.workload.model or served_model(self.host or "")
        # An OpenAI client's base URL (``http://host:8000/v1``) works as --host too.
        path = CHAT_PATH if self.workload.api == "chat" else COMPLETIONS_PATH
        self.completions_path = path
        if (self.host or "").rstrip("/").endswith("/v1"):
            self.completions_path = path.removeprefix("/v1")

    @task
    def complete(self) -> None:
        self.stream_completion(self.workload.request_body(self.rng, self.model))

    def stream_completion(self, body: dict[str, Any]) -> StreamTiming:
        """POST one streaming completion; fire Locust entries and record exact figures."""
        headers = {TENANT_HEADER: self.tenant, "Accept": "text/event-stream",
                   "Accept-Encoding": "identity", **auth_headers()}
        sent_wall = time.time()
        timing = StreamTiming(sent=time.perf_counter())
        error: str | None = None
        try:
            with self.client.post(self.completions_path, json=body, headers=headers, stream=True,
                                  catch_response=True, name="end_to_end") as response:
                if response.status_code != 200:
                    error = _http_error(response)
                else:
                    error = self._read_stream(response, timing)
                timing.end(time.perf_counter())
                response.request_meta["response_time"] = (timing.e2e or 0.0) * 1000.0
                response.request_meta["response_length"] = timing.tokens
                if error is None:
                    response.success()
                else:
                    response.failure(error)
        except GreenletExit:
            # Locust stops users mid-stream when a run ends: keep what arrived, marked cut, so the
            # tokens of long requests count where they arrived instead of vanishing.
            self._record(sent_wall, timing, ok=False, error=None, cut=True)
            raise
        self._last_failed = error is not None
        self._fire_token_entries(timing, ok=error is None)
        self._record(sent_wall, timing, ok=error is None, error=error)
        return timing

    def _record(self, sent_wall: float, timing: StreamTiming, ok: bool, error: str | None,
                cut: bool = False) -> None:
        recorder = getattr(self.environment, "gpuscope_recorder", None)
        if recorder is not None:
            recorder.add(sent_wall, self.tenant, ok, timing.ttft, timing.e2e, timing.tokens,
                         timing.inter_token, error, cut)

    def _read_stream(self, response: Any, timing: StreamTiming) -> str | None:
        # See the module docstring for why not iter_content. A stream abandoned on an error is
        # never returned to the pool: geventhttpclient closes its socket when the response is freed.
        raw = response._response
        done = False
        try:
            while True:
                line = raw.readline(b"\n")
                now = time.perf_counter()
                if not line:
                    break
                chunk = parse_sse_line(line)
                if chunk is DONE:
                    done = True
                elif isinstance(chunk, Chunk):
                    timing.chunk(chunk, now)
        except StreamError as exc:
            return str(exc)
        except OSError as exc:
            return f"stream broken: {exc}"
        return None if done else "stream ended without [DONE]"

    def _fire_token_entries(self, timing: StreamTiming, ok: bool) -> None:
        if not ok or timing.ttft is None:
            return
        fire = self.environment.events.request.fire
        common = {"request_type": "SSE", "exception": None, "context": {}, "response": None, "url": None}
        fire(name="time_to_first_token", response_time=timing.ttft * 1000.0, response_length=0, **common)
        for gap in timing.inter_token:
            fire(name="inter_token_latency", response_time=gap * 1000.0, response_length=0, **common)
        for _ in range(timing.tokens):
            fire(name="output_tokens", response_time=0, response_length=1, **common)


def _http_error(response: Any) -> str:
    code = response.status_code
    if not code:
        return f"no response: {getattr(response, 'error', None)!r}"
    try:
        text = (response.text or "").strip().replace("\n", " ")
    except Exception:  # the body of a failed response is only decoration for the message
        text = ""
    return f"HTTP {code}: {text[:200]}"


def tenant_users(tenants: dict[str, float], module: str) -> dict[str, type[CompletionsUser]]:
    """One concrete user class per tenant, weighted; Locust needs integer weights.

    Weights are scaled so the smallest is 1 and rounded; ``module`` makes the
    classes look defined in the locustfile (Locust lists them by module).
    """
    smallest = min(tenants.values())
    classes: dict[str, type[CompletionsUser]] = {}
    for tenant, weight in tenants.items():
        name = tenant_class_name(tenant)
        classes[name] = type(name, (CompletionsUser,), {
            "tenant": tenant,
            "weight": max(1, round(weight / smallest)),
            "abstract": False,
            "__module__": module,
            "__doc__": f"Streaming completions as tenant {tenant!r}.",
        })
    return classes
