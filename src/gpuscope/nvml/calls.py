"""One guarded NVML call: errors counted, unsupported fields dropped, lost GPUs detected.

Every sampler goes through :class:`Calls`, so the error policy lives in one place:

- ``NOT_SUPPORTED`` / ``FUNCTION_NOT_FOUND``: the device will never answer; remember it and
  stop asking that call on that device (no error spam), logged once at info level.
- ``GPU_IS_LOST``: the GPU fell off the bus; mark it lost (counted once) and abandon it.
- anything else: count ``gpuscope_exporter_errors_total{call}``, log once, skip the field.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from gpuscope.nvml.api import GPU_IS_LOST, UNSUPPORTED_CODES, NVMLError, error_code, error_text
from gpuscope.nvml.devices import Device
from gpuscope.nvml.health import Health

log = logging.getLogger("gpuscope.exporter")
_MISSING = object()


class DeviceLost(Exception):
    """Raised out of a sampling function when its GPU fell off the bus."""


class Calls:
    """Calls NVML for one device round, tracking what succeeded and what is in flight."""

    def __init__(self, nv: Any, health: Health) -> None:
        self.nv = nv
        self.health = health
        # Thread id -> (call, device label) in flight: read by the sampler when a lane times out.
        self._in_flight: dict[int, tuple[str, str]] = {}

    def in_flight(self, thread_id: int | None) -> tuple[str, str] | None:
        return self._in_flight.get(thread_id) if thread_id is not None else None

    def call(self, device: Device, name: str, *args: Any, variant: str = "",
             empty_on: Iterable[int] = (), empty: Any = None) -> Any:
        """``nv.<name>(device.handle, *args)``, or None when it failed or is unsupported.

        ``variant`` names a distinct unsupported-memo key for calls whose support depends on
        an argument (a clock type, a temperature sensor); ``empty_on`` lists codes that mean
        "no data" rather than failure (process utilization answers NOT_FOUND when idle).
        """
        key = variant or name
        if key in device.unsupported:
            return None
        fn = getattr(self.nv, name, None)
        if fn is None:  # an older pynvml without this binding
            device.unsupported.add(key)
            return None
        tid = threading.get_ident()
        self._in_flight[tid] = (name, device.label)
        try:
            return fn(device.handle, *args)
        except NVMLError as exc:
            code = error_code(exc)
            if code in empty_on:
                return empty
            if code in UNSUPPORTED_CODES:
                device.unsupported.add(key)
                self.health.log_once(("unsupported", key, device.label), logging.INFO,
                                     "gpu %s: %s not supported; no longer asked", device.label, key)
                return None
            self.health.count_error(name)
            if code == GPU_IS_LOST:
                if self.health.mark_lost(device.label):
                    log.error("gpu %s is lost (fell off the bus); other GPUs continue", device.label)
                raise DeviceLost(device.label) from exc
            self.health.log_once(("error", name, device.label, code), logging.WARNING,
                                 "gpu %s: %s failed: %s (counted in gpuscope_exporter_errors_total)",
                                 device.label, name, error_text(exc))
            return None
        finally:
            self._in_flight.pop(tid, None)

    def first(self, device: Device, names: Iterable[str], *args: Any) -> Any:
        """The first binding that exists and answers (for calls NVML renamed across versions)."""
        for name in names:
            if name in device.unsupported or getattr(self.nv, name, None) is None:
                continue
            value = self.call(device, name, *args)
            if value is not None or name not in device.unsupported:
                return value
        return None
