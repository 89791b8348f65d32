"""Fault injection for validating alerts: each fault is the real symptom, made on purpose.

- ``latency_spike``: extra real passes of work inside every timed MLP module, so
  kernel-timing histograms and request latency rise together.
- ``memory_leak``: device memory (process memory on CPU) retained at a rate in
  bytes per second, so ``gpuscope_device_memory_*`` grows linearly.
- ``starvation``: the scheduler stops serving a named tenant while its queue holds work.
- ``error_burst``: CUDA out-of-memory error log lines in the text torch prints, at a
  rate, and requests failing with ``outcome="error"``.

Off unless the server starts with ``--faults.enable`` and a token (``main`` and
the API enforce that). Activation comes from the event loop; effects are
applied by the engine thread between steps (``apply``), so the model is only
ever touched by the thread that runs it.
"""

from __future__ import annotations

import logging
import math
import mmap
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("gpuscope.server")

FAULTS = ("latency_spike", "memory_leak", "starvation", "error_burst")
MAX_DURATION_S = 3600.0
_MIB = 1 << 20


class FaultError(ValueError):
    """A fault request that cannot be honoured; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _number(body: dict, key: str, default: float, low: float, high: float, integer: bool = False) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FaultError(400, f"{key} must be a number")
    if integer and int(value) != value:
        raise FaultError(400, f"{key} must be a whole number")
    if not low <= value <= high:
        raise FaultError(400, f"{key} must be between {low:g} and {high:g}, got {value:g}")
    return int(value) if integer else float(value)


@dataclass
class Fault:
    name: str
    params: dict[str, Any]
    started: float
    until: float
    done: dict[str, float] = field(default_factory=dict)  # progress of rate-driven effects

    def public(self, now: float) -> dict[str, Any]:
        return {"name": self.name, "params": self.params, "remaining_s": round(max(0.0, self.until - now), 3)}


def oom_message(device: torch.device, requested: int) -> str:
    """An out-of-memory line worded as torch's CUDA caching allocator words it."""
    gib = 1 << 30
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * gib
    index = device.index or 0
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {requested / gib:.2f} GiB. "
            f"GPU {index} has a total capacity of {total / gib:.2f} GiB of which 3.19 MiB is free. "
            f"Including non-PyTorch memory, this process has {total / gib - 0.01:.2f} GiB memory in use. "
            f"Of the allocated memory {total / gib - 0.6:.2f} GiB is allocated by PyTorch, and 401.05 MiB "
            "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


class FaultInjector:
    def __init__(self, tenants: set[str], device: torch.device, clock=time.monotonic) -> None:
        self._tenants = tenants
        self._device = device
        self._clock = clock
        self._lock = threading.Lock()
        self._faults: dict[str, Fault] = {}
        # Engine-thread state: what is applied now.
        self._leaked: list[torch.Tensor | mmap.mmap] = []
        self._passes = 0
        self._starved: str | None = None
        self._rng = random.Random(0)

    # --- API side ----------------------------------------------------------------
    def activate(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if name not in FAULTS:
            raise FaultError(404, f"unknown fault {name!r}; one of {', '.join(FAULTS)}")
        if not isinstance(body, dict):
            raise FaultError(400, "body must be a JSON object")
        duration = _number(body, "duration_s", 60.0, 0.1, MAX_DURATION_S)
        if name == "latency_spike":
            params = {"extra_passes": _number(body, "extra_passes", 8, 1, 256, integer=True)}
        elif name == "memory_leak":
            params = {"rate_bytes_per_s": _number(body, "rate_bytes_per_s", 16 * _MIB, 1, 1 << 30),
                      "max_bytes": _number(body, "max_bytes", 1 << 30, _MIB, 1 << 40)}
        elif name == "starvation":
            tenant = body.get("tenant")
            if not isinstance(tenant, str) or tenant not in self._tenants:
                raise FaultError(400, f"tenant must be one of {', '.join(sorted(self._tenants))}")
            params = {"tenant": tenant}
        else:
            params = {"log_lines_per_s": _number(body, "log_lines_per_s", 5.0, 0.0, 1000.0),
                      "error_ratio": _number(body, "error_ratio", 1.0, 0.0, 1.0)}
        now = self._clock()
        fault = Fault(name, {"duration_s": duration, **params}, now, now + duration)
        with self._lock:
            self._faults[name] = fault
        log.warning("fault %s activated for %.1fs with %s", name, duration, params,
                    extra={"fault": name})
        return fault.public(now)

    def clear(self, name: str) -> bool:
        if name not in FAULTS:
            raise FaultError(404, f"unknown fault {name!r}; one of {', '.join(FAULTS)}")
        with self._lock:
            removed = self._faults.pop(name, None) is not None
        if removed:
            log.warning("fault %s cleared", name, extra={"fault": name})
        return removed

    def _live(self) -> dict[str, Fault]:
        now = self._clock()
        with self._lock:
            for name in [n for n, f in self._faults.items() if f.until <= now]:
                del self._faults[name]
            return dict(self._faults)

    def active(self) -> dict[str, bool]:
        live = self._live()
        return {name: name in live for name in FAULTS}

    def describe(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [f.public(now) for f in self._live().values()]

    # --- engine side -------------------------------------------------------------
    def apply(self, model, scheduler) -> None:
        """Bring the model, scheduler and leaked memory in line with the active faults."""
        live = self._live()
        now = self._clock()
        spike = live.get("latency_spike")
        passes = spike.params["extra_passes"] if spike else 0
        if passes != self._passes:
            model.set_extra_passes(passes)
            self._passes = passes
        starve = live.get("starvation")
        tenant = starve.params["tenant"] if starve else None
        if tenant != self._starved:
            scheduler.set_starved(tenant)
            self._starved = tenant
        leak = live.get("memory_leak")
        if leak:
            self._leak(leak, now)
        elif self._leaked:
            for block in self._leaked:
                if isinstance(block, mmap.mmap):
                    block.close()
            self._leaked.clear()
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
        burst = live.get("error_burst")
        if burst:
            due = int((now - burst.started) * burst.params["log_lines_per_s"])
            due -= int(burst.done.get("lines", 0))
            for _ in range(min(due, 100)):
                log.error(oom_message(self._device, self._rng.choice((2, 4, 8, 16)) << 28),
                          extra={"fault": "error_burst"})
            burst.done["lines"] = burst.done.get("lines", 0) + max(0, due)

    def _leak(self, fault: Fault, now: float) -> None:
        target = min(fault.params["max_bytes"], fault.params["rate_bytes_per_s"] * (now - fault.started))
        held = fault.done.get("bytes", 0.0)
        chunk = int(target - held)
        if chunk < min(_MIB, fault.params["rate_bytes_per_s"]):
            return
        try:
            self._leaked.append(_retain(chunk, self._device))
            fault.done["bytes"] = held + chunk
        except (RuntimeError, MemoryError):
            log.exception("memory_leak fault could not allocate %d bytes", chunk)
            fault.done["bytes"] = target

    def fail_request(self) -> str | None:
        """The error a new request should fail with under ``error_burst``, or None."""
        burst = self._live().get("error_burst")
        if burst and self._rng.random() < burst.params["error_ratio"]:
            return oom_message(self._device, 1 << 30)
        return None


def _retain(nbytes: int, device: torch.device) -> torch.Tensor | mmap.mmap:
    """``nbytes`` of memory that counts as the server's own until released.

    On CPU an anonymous mapping, every page touched so it is resident: malloc'd memory (a CPU
    tensor) may stay in the heap after it is freed, so the "leak" would not visibly end.
    """
    if device.type != "cpu":
        return torch.ones(nbytes, dtype=torch.uint8, device=device)
    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        block[offset] = 1
    return block
