"""On-demand profile captures of the next N engine steps, asked for through ``POST /admin/profile``.

A request (the API's event loop, usually the alert receiver on a firing latency alert) is checked and
rate-limited here: at most one accepted capture per ``min_interval_s``, one at a time. The engine
thread then drives it between steps (``tick`` at each iteration, ``after_step`` after each step):
it starts the recorder (``recorders.py``: kernels through torch.profiler on CUDA, else the
timer's regions), counts the asked steps and stops it; a background thread builds the trace, caps
it, writes it (``trace.py``), prunes old ones and logs one ``profile_captured`` line that
links to it (the server's structured log, shipped to Loki). So the engine thread pays only the
recorder's start and stop (counted in ``gpuscope_profile_stall_seconds_total``) and the window's own
slowdown, which is measured: tokens per step-second during the window against the same over the
steps just before it (``gpuscope_profile_throughput_loss_ratio``).

Nothing here may break the engine: a failure to start or stop is caught, undone, counted
(``outcome="failed"``) and logged once per capture.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gpuscope.contract import catalogue as c

from . import trace as pt
from .config import MODES, ProfileConfig
from .recorders import KernelRecorder, RegionRecorder, kernels_available

log = logging.getLogger("gpuscope.server.profile")

REQUEST_RESULTS = ("accepted", "rate_limited", "busy", "unavailable")
OUTCOMES = ("ok", "partial", "failed")
#: Steps before a window that its throughput is compared with.
BASELINE_STEPS = 64
#: Most captures remembered for GET /admin/profile (their files follow --profile.keep).
HISTORY = 100
MAX_REASON = 200
MAX_ALERT_LABELS = 64
MAX_LABEL_CHARS = 1024


class ProfileError(Exception):
    """A capture request that cannot be honoured: the HTTP status, message and Retry-After seconds."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


@dataclass
class Capture:
    """One capture's request and what became of it (``public()`` is what the API shows)."""

    id: str
    mode: str
    steps: int
    reason: str
    alert: dict[str, str]
    requested_at: float  # unix time
    state: str = "pending"  # pending → capturing → writing → done
    outcome: str | None = None
    steps_captured: int = 0
    file: str | None = None
    bytes: int = 0
    events: int = 0
    events_left_out: int = 0
    throughput_loss_ratio: float | None = None
    stall_s: float = 0.0
    window_s: float = 0.0
    error: str | None = None
    deleted: bool = False
    # engine-thread state
    recorder: Any = None
    prepared_at: float = 0.0
    started_at: float = 0.0
    window_tokens: int = 0
    window_step_s: float = 0.0
    baseline: tuple[int, float] = (0, 0.0)
    extra: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        out = {"id": self.id, "mode": self.mode, "steps": self.steps, "reason": self.reason,
               "alert": self.alert, "requested_at": self.requested_at, "state": self.state,
               "outcome": self.outcome, "steps_captured": self.steps_captured,
               "trace_path": trace_path(self.id), "status_path": status_path(self.id),
               "file": self.file, "bytes": self.bytes, "events": self.events,
               "events_left_out": self.events_left_out, "throughput_loss_ratio": self.throughput_loss_ratio,
               "stall_s": round(self.stall_s, 6), "window_s": round(self.window_s, 6), "error": self.error,
               "deleted": self.deleted}
        return out


def trace_path(capture_id: str) -> str:
    return f"/admin/profile/{capture_id}/trace"


def status_path(capture_id: str) -> str:
    return f"/admin/profile/{capture_id}"


def parse_request(body: Any, config: ProfileConfig) -> dict[str, Any]:
    """A capture request's body → {steps, mode, reason, alert}; ProfileError(400) naming what is wrong."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ProfileError(400, "body must be a JSON object: {\"steps\", \"mode\", \"reason\", \"alert\"}")
    unknown = sorted(set(body) - {"steps", "mode", "reason", "alert"})
    if unknown:
        raise ProfileError(400, f"unknown field {unknown[0]!r}; fields: steps, mode, reason, alert")
    steps = body.get("steps", config.default_steps)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= config.max_steps:
        raise ProfileError(400, f"steps must be a whole number between 1 and {config.max_steps}, "
                                f"got {steps!r}")
    mode = body.get("mode", "auto")
    if mode not in MODES:
        raise ProfileError(400, f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    reason = body.get("reason", "")
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise ProfileError(400, f"reason must be a string of at most {MAX_REASON} characters")
    alert = body.get("alert", {})
    if (not isinstance(alert, dict) or len(alert) > MAX_ALERT_LABELS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= MAX_LABEL_CHARS
                       for k, v in alert.items())):
        raise ProfileError(400, f"alert must be an object of at most {MAX_ALERT_LABELS} string labels "
                                f"(name + value at most {MAX_LABEL_CHARS} characters)")
    return {"steps": steps, "mode": mode, "reason": reason, "alert": alert}


class ProfileCapture:
    """Rate-limited captures of one server's engine steps (module docstring)."""

    def __init__(self, config: ProfileConfig, registry: CollectorRegistry, *, timer: Any,
                 instrumentation: Any, device: Any, instance: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.timer = timer
        self.instrumentation = instrumentation
        self.device = device
        self.instance = instance
        self.clock = clock
        self._lock = threading.Lock()
        self._captures: deque[Capture] = deque(maxlen=HISTORY)
        self._active: Capture | None = None  # from accepted until written
        self._next_allowed = -math.inf
        self._baseline: deque[tuple[int, float]] = deque(maxlen=BASELINE_STEPS)
        self._requests = c.PROFILE_REQUESTS.create(registry)
        for result in REQUEST_RESULTS:
            self._requests.labels(result)
        self._outcomes = c.PROFILE_CAPTURES.create(registry)
        for mode in ("kernels", "regions"):
            for outcome in OUTCOMES:
                self._outcomes.labels(mode, outcome)
        self._loss = c.PROFILE_THROUGHPUT_LOSS.create(registry)
        self._stall = c.PROFILE_STALL_SECONDS.create(registry)
        self._bytes = c.PROFILE_TRACE_BYTES.create(registry)
        self._dropped = c.PROFILE_EVENTS_DROPPED.create(registry)
        for reason in ("count_cap", "byte_cap"):
            self._dropped.labels(reason)
        self._retained = c.PROFILE_TRACES_RETAINED.create(registry)
        self._retained.set(len(pt.trace_files(config.directory)))

    # --- API side (event loop) ----------------------------------------------------------------

    def request(self, body: Any) -> Capture:
        """Accept a capture (ProfileError: 400 bad body, 409 busy or unavailable, 429 too soon)."""
        parsed = parse_request(body, self.config)
        mode = self._resolve_mode(parsed["mode"])
        now = self.clock()
        with self._lock:
            if self._active is not None:
                self._requests.labels("busy").inc()
                raise ProfileError(409, f"capture {self._active.id} is in progress; see "
                                        f"{status_path(self._active.id)}", retry_after=1)
            if now < self._next_allowed:
                wait = max(1, math.ceil(self._next_allowed - now))
                self._requests.labels("rate_limited").inc()
                raise ProfileError(429, f"at most one capture per {self.config.min_interval_s:g}s; the next "
                                        f"one is allowed in {wait}s", retry_after=wait)
            capture = Capture(uuid.uuid4().hex[:12], mode, parsed["steps"], parsed["reason"], parsed["alert"],
                              time.time())
            self._next_allowed = now + self.config.min_interval_s
            self._captures.append(capture)
            self._active = capture
            self._requests.labels("accepted").inc()
        log.info("profile capture %s accepted: %d steps, %s (%s)", capture.id, capture.steps, mode,
                 capture.reason or "no reason given")
        return capture

    def _resolve_mode(self, asked: str) -> str:
        kernels = kernels_available(self.device)
        regions = self.instrumentation is not None
        if asked == "auto":
            asked = "kernels" if kernels else "regions"
        if asked == "kernels" and not kernels:
            self._requests.labels("unavailable").inc()
            raise ProfileError(409, "mode kernels needs CUDA and torch.profiler's CUDA activity; "
                                    "ask for mode regions")
        if asked == "regions" and not regions:
            self._requests.labels("unavailable").inc()
            raise ProfileError(409, "mode regions needs the kernel timer (the server runs with --timing off)")
        return asked

    def get(self, capture_id: str) -> Capture | None:
        with self._lock:
            return next((cap for cap in self._captures if cap.id == capture_id), None)

    def captures(self) -> list[dict[str, Any]]:
        with self._lock:
            return [cap.public() for cap in self._captures]

    def next_allowed_in_s(self) -> float:
        return max(0.0, self._next_allowed - self.clock())

    def trace_file(self, capture_id: str) -> str:
        """The trace file's path (ProfileError: 404 unknown, 409 not written yet, 410 deleted or failed)."""
        cap = self.get(capture_id)
        if cap is None:
            raise ProfileError(404, f"no capture {capture_id!r} (GET /admin/profile lists them)")
        if cap.state != "done":
            raise ProfileError(409, f"capture {capture_id} is {cap.state}; its trace is not written yet",
                               retry_after=1)
        if cap.file is None:
            raise ProfileError(410, f"capture {capture_id} wrote no trace: {cap.error or cap.outcome}")
        if cap.deleted:
            raise ProfileError(410, f"the trace of capture {capture_id} was deleted (--profile.keep "
                                    f"{self.config.keep})")
        return cap.file

    # --- engine thread -----------------------------------------------------------------------

    def warm_up(self) -> None:
        """Before the engine reports ready: start and stop torch.profiler once where kernel captures
        can run. Its first use in a process sets up Kineto and CUPTI, which stalls the engine far
        longer in the first capture than in the ones after (docs/server.md, "Kernel profiles on an
        alert", gives the H200's figures). Never raises."""
        if not kernels_available(self.device):
            return
        t0 = time.perf_counter()
        recorder = KernelRecorder(None, self._busy())
        try:
            recorder.start()
            import torch

            torch.ones(1, device=self.device).add_(1)
            recorder.stop()
        except Exception as exc:
            recorder.abort()
            log.warning("profile: warming torch.profiler up failed (the first capture pays it): %r", exc)
            return
        log.info("profile: torch.profiler warmed up in %.2fs", time.perf_counter() - t0)

    def tick(self) -> None:
        """Each engine iteration: start an accepted capture, or end one whose time is up."""
        cap = self._active
        if cap is None or cap.state not in ("pending", "capturing"):
            return
        now = self.clock()
        try:
            if cap.state == "pending":
                self._begin(cap, now)
            elif now - cap.started_at > self.config.window_timeout_s:
                self._end(cap, now)
        except Exception as exc:
            self._fail(cap, exc)

    def after_step(self, op: str, batch_size: int, seconds: float) -> None:
        """After each engine step: its tokens (one per request) and host seconds, sync included."""
        cap = self._active
        if cap is None or cap.state != "capturing":
            self._baseline.append((batch_size, seconds))
            return
        try:
            cap.recorder.step(op, batch_size, seconds)
            cap.steps_captured += 1
            cap.window_tokens += batch_size
            cap.window_step_s += seconds
            if cap.steps_captured >= cap.steps:
                self._end(cap, self.clock())
        except Exception as exc:
            self._fail(cap, exc)

    def _begin(self, cap: Capture, now: float) -> None:
        if cap.recorder is None:
            cap.recorder = self._recorder(cap.mode)
            cap.prepared_at = now
            t0 = time.perf_counter()
            cap.recorder.prepare()
            cap.stall_s += time.perf_counter() - t0
        if not cap.recorder.ready():
            if now - cap.prepared_at > self.config.window_timeout_s:
                raise RuntimeError("CUPTI stayed busy with a kernel busy window")
            return
        t0 = time.perf_counter()
        cap.recorder.start()
        cap.stall_s += time.perf_counter() - t0
        tokens = sum(b for b, _ in self._baseline)
        cap.baseline = (tokens, sum(s for _, s in self._baseline))
        cap.started_at = self.clock()
        cap.state = "capturing"

    def _busy(self) -> Any:
        """The timer's kernel busy window, if on (HostClock, with --timing off, has no core)."""
        return getattr(getattr(self.timer, "core", None), "busy", None)

    def _recorder(self, mode: str) -> Any:
        if mode == "kernels":
            return KernelRecorder(self.instrumentation, self._busy())
        return RegionRecorder(self.timer, self.instrumentation, self.config.max_events)

    def _end(self, cap: Capture, now: float) -> None:
        t0 = time.perf_counter()
        cap.state = "writing"
        cap.window_s = now - cap.started_at
        cap.recorder.stop()
        stall = time.perf_counter() - t0
        cap.stall_s += stall
        self._stall.inc(cap.stall_s)
        base_tokens, base_s = cap.baseline
        if base_tokens and base_s > 0 and cap.window_step_s > 0 and cap.window_tokens:
            loss = 1.0 - (cap.window_tokens / cap.window_step_s) / (base_tokens / base_s)
            cap.throughput_loss_ratio = round(loss, 4)
            self._loss.set(loss)
        cap.outcome = "ok" if cap.steps_captured >= cap.steps else "partial"
        threading.Thread(target=self._write, args=(cap,), name="gpuscope-profile-writer", daemon=True).start()

    def _fail(self, cap: Capture, exc: BaseException, undo: bool = True) -> None:
        """Count and log a failed capture; ``undo`` (engine thread only) restores the model."""
        recorder = cap.recorder
        if undo and recorder is not None:
            try:
                recorder.abort()
            except Exception:
                log.exception("profile capture %s: undoing the recorder failed", cap.id)
        cap.error = f"{type(exc).__name__}: {exc}"[:300]
        self._done(cap, "failed")
        log.warning("profile capture %s failed (counted): %s", cap.id, cap.error)

    def _done(self, cap: Capture, outcome: str) -> None:
        cap.outcome = outcome
        cap.recorder = None
        self._outcomes.labels(cap.mode, outcome).inc()
        with self._lock:
            cap.state = "done"
            if self._active is cap:
                self._active = None

    # --- writer thread -------------------------------------------------------------------------

    def _write(self, cap: Capture) -> None:
        try:
            trace = cap.recorder.finish(timeout_s=10.0)
            events, left_count = pt.cap_events(trace["traceEvents"], self.config.max_events)
            left_count += int(trace["otherData"].get("events_left_out_count", 0))
            trace["traceEvents"] = events
            trace["otherData"].update(self._other_data(cap))
            trace["otherData"]["events_left_out_count"] = left_count
            body, left_bytes = pt.encode(trace, self.config.max_bytes)
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(cap.requested_at))
            path = pt.write_atomic(self.config.directory, pt.file_name(stamp, cap.id), body)
            deleted = pt.prune(self.config.directory, self.config.keep)
        except Exception as exc:
            self._fail(cap, exc, undo=False)  # the recorder was stopped on the engine thread
            return
        cap.file, cap.bytes = path, len(body)
        cap.events = len(events) - left_bytes
        cap.events_left_out = left_count + left_bytes
        self._dropped.labels("count_cap").inc(left_count)
        self._dropped.labels("byte_cap").inc(left_bytes)
        self._bytes.set(len(body))
        self._retained.set(len(pt.trace_files(self.config.directory)))
        with self._lock:
            for old in self._captures:
                if old.file is not None and old.file.rsplit("/", 1)[-1] in deleted:
                    old.deleted = True
        self._done(cap, cap.outcome or "ok")
        self._log(cap)

    def _other_data(self, cap: Capture) -> dict[str, Any]:
        return {"gpuscope_capture": cap.id, "mode": cap.mode, "reason": cap.reason, "alert": cap.alert,
                "steps_asked": cap.steps, "steps_captured": cap.steps_captured,
                "window_s": round(cap.window_s, 6), "throughput_loss_ratio": cap.throughput_loss_ratio,
                "instance": self.instance, "device": str(self.device)}

    def _log(self, cap: Capture) -> None:
        url = f"http://{self.instance}{trace_path(cap.id)}" if self.instance else trace_path(cap.id)
        line = {"event": "profile_captured", "capture_id": cap.id, "mode": cap.mode, "outcome": cap.outcome,
                "steps": cap.steps_captured, "reason": cap.reason,
                "alertname": cap.alert.get("alertname", ""), "trace_url": url, "file": cap.file,
                "bytes": cap.bytes, "events": cap.events, "events_left_out": cap.events_left_out,
                "throughput_loss_ratio": cap.throughput_loss_ratio, "stall_s": round(cap.stall_s, 6)}
        log.info(json.dumps(line, separators=(",", ":")))
