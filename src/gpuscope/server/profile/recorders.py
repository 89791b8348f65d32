"""The two ways a capture records the steps it spans (``capture.py`` drives them on the engine thread).

- :class:`KernelRecorder` (mode ``kernels``, on CUDA): ``torch.profiler`` with CPU and CUDA activity,
  that is every kernel under the name CUPTI gives it, with each instrumented module's forward as a
  ``record_function`` range and each engine step as a ``ProfilerStep#N`` range.
- :class:`RegionRecorder` (mode ``regions``, anywhere the timer runs): the timer's per-op regions
  at full sampling for the window, each one a complete event at its host start time whose duration
  is the timer's measurement (GPU time from CUDA events on a GPU, wall time on the host clock), plus
  one event per engine step.

Both take the model's modules from the timer's ``Instrumentation`` and put their own wrappers on them
for the window, with the instrumentation detached meanwhile (its sampled passes, and so the kernel
busy window's traced passes, stop until the window ends). CUPTI admits one activity client per
process: a kernel capture waits until no busy window is open, and afterwards hands CUPTI back to the
busy window's tracer (``reclaim``), since torch.profiler's Kineto registers its own buffer callbacks.

Call order, all on the engine thread except ``finish``: ``prepare``, ``ready`` (until true),
``start``, ``step`` per engine step, ``stop``; then ``finish`` on any thread builds the trace.
``abort`` undoes whatever was done, after a failure.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from . import trace as pt

STEP_TID, REGION_TID = 1, 2


def kernels_available(device: Any) -> bool:
    """Whether torch.profiler can record CUDA kernels for this device."""
    if getattr(device, "type", "cpu") != "cuda":
        return False
    try:
        from torch.profiler import ProfilerActivity, supported_activities
    except ImportError:
        return False
    return ProfilerActivity.CUDA in supported_activities()


class _Wrappers:
    """Per-module forwards installed for the window, the instrumentation detached meanwhile."""

    def __init__(self, instrumentation: Any) -> None:
        self.inst = instrumentation
        self.modules: list[Any] = []

    def install(self, make: Callable[[Any, Callable], Callable]) -> None:
        inst = self.inst
        if inst is None:
            return
        inst.detach()
        for (module, _), op in zip(inst.wrappers, inst.op_states, strict=True):
            module.__dict__.pop("forward", None)  # the class's forward, not a sampled pass's wrapper
            module.__dict__["forward"] = make(op, module.forward)
            self.modules.append(module)

    def remove(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules.clear()
        if self.inst is not None:
            self.inst.attach()


class RegionRecorder:
    """The timer's per-op regions at full sampling (module docstring)."""

    mode = "regions"

    def __init__(self, timer: Any, instrumentation: Any, max_events: int) -> None:
        self.core = timer.core
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self.expected = 0  # regions whose measurement is awaited from the resolver
        self.arrived = 0
        self._wrappers = _Wrappers(instrumentation)
        self._t0 = 0
        self._lock = threading.Lock()

    def prepare(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def start(self) -> None:
        self._t0 = time.perf_counter_ns()
        self._wrappers.install(self._wrap)

    def _wrap(self, op: Any, original: Callable) -> Callable:
        record_start, end, clock = self.core.record_start, self.core.end, time.perf_counter_ns
        name = op.name

        def forward(*args: Any, **kwargs: Any) -> Any:
            op.entered += 1
            began = clock()
            token = record_start()
            try:
                return original(*args, **kwargs)
            finally:
                if token is not None:
                    self.expected += 1
                    host_ns = clock() - began
                    end(op, token, lambda seconds: self._region(name, began, host_ns, seconds))
                else:  # no event to record into (pool empty, counted by the timer): host time only
                    self._region(name, began, clock() - began, None)

        return forward

    def _region(self, name: str, began_ns: int, host_ns: int, seconds: float | None) -> None:
        """A region's measurement (on the resolver thread, or the engine thread without one)."""
        with self._lock:
            if seconds is not None:
                self.arrived += 1
            if len(self.events) >= self.max_events:
                self.dropped += 1
                return
            measured_us = seconds * 1e6 if seconds is not None else host_ns / 1e3
            self.events.append(pt.complete(name, "region", (began_ns - self._t0) / 1e3, measured_us,
                                           REGION_TID, {"host_us": round(host_ns / 1e3, 3),
                                                        "timed": seconds is not None}))

    def step(self, op: str, batch_size: int, seconds: float) -> None:
        now = time.perf_counter_ns()
        with self._lock:
            if len(self.events) >= self.max_events:
                self.dropped += 1
                return
            self.events.append(pt.complete(op, "step", (now - self._t0) / 1e3 - seconds * 1e6, seconds * 1e6,
                                           STEP_TID, {"batch_size": batch_size}))

    def stop(self) -> None:
        self._wrappers.remove()

    def abort(self) -> None:
        self._wrappers.remove()

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """The trace, once the resolver has measured every region (or ``timeout_s`` passed: those
        not measured by then are left out and counted in ``otherData.regions_unresolved``)."""
        deadline = time.monotonic() + timeout_s
        while self.arrived < self.expected and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            events = sorted(self.events, key=lambda e: e["ts"])
            unresolved = self.expected - self.arrived
        label = "timer regions (" + self.core.route.__class__.__name__ + ")"
        meta = pt.names(0, "gpuscope serve", [(STEP_TID, "engine steps"), (REGION_TID, label)])
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"regions_unresolved": unresolved, "events_left_out_count": self.dropped}}


class KernelRecorder:
    """torch.profiler with CUDA activity (module docstring)."""

    mode = "kernels"

    def __init__(self, instrumentation: Any, busy: Any) -> None:
        self.busy = busy
        self._wrappers = _Wrappers(instrumentation)
        self._prof: Any = None
        self._prepared = False

    def prepare(self) -> None:
        # Detach first: no sampled pass can then open a kernel busy window; one already open
        # closes once the resolver has its regions (ready() waits for that).
        if self._wrappers.inst is not None:
            self._wrappers.inst.detach()
        self._prepared = True

    def ready(self) -> bool:
        return self.busy is None or not self.busy.tracing

    def start(self) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

        def wrap(op: Any, original: Callable) -> Callable:
            name = op.name

            def forward(*args: Any, **kwargs: Any) -> Any:
                with record_function(name):
                    return original(*args, **kwargs)

            return forward

        # A schedule that always records: with one given, torch.profiler marks each step() as a
        # ProfilerStep#N range (without one it marks nothing).
        self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                             schedule=lambda step: ProfilerAction.RECORD)
        self._prof.start()
        self._wrappers.install(wrap)

    def step(self, op: str, batch_size: int, seconds: float) -> None:
        self._prof.step()

    def stop(self) -> None:
        try:
            self._prof.stop()
        finally:
            self._release()

    def abort(self) -> None:
        try:
            if self._prof is not None:
                self._prof.stop()
        except Exception:  # stopping a profiler that never started: nothing to undo
            pass
        finally:
            self._release()

    def _release(self) -> None:
        self._wrappers.remove()
        reclaim = getattr(getattr(self.busy, "trace", None), "reclaim", None)
        if reclaim is not None:
            reclaim()

    def finish(self, timeout_s: float) -> dict[str, Any]:
        fd, path = tempfile.mkstemp(prefix=".torch-trace-", suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                trace = json.load(f)
        finally:
            os.unlink(path)
        self._prof = None
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise ValueError("torch.profiler wrote no traceEvents")
        trace.setdefault("otherData", {})
        return trace
