"""Self-health bookkeeping shared by every sampler thread: errors by call, lost GPUs, logging once.

Writers are the sampler threads; the reader is the scrape. Everything here is cheap and
guarded by one lock that is never held across an NVML call.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("gpuscope.exporter")


class Health:
    """Counters behind ``gpuscope_exporter_errors_total`` and ``gpuscope_exporter_gpus_lost_total``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: dict[str, int] = {}
        self._lost: set[str] = set()
        self._logged: set[tuple] = set()

    def count_error(self, call: str) -> None:
        with self._lock:
            self._errors[call] = self._errors.get(call, 0) + 1

    def mark_lost(self, gpu: str) -> bool:
        """Record a lost GPU; True the first time only, so it is counted and logged once."""
        with self._lock:
            if gpu in self._lost:
                return False
            self._lost.add(gpu)
        return True

    def is_lost(self, gpu: str) -> bool:
        return gpu in self._lost

    def errors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._errors)

    def lost_count(self) -> int:
        return len(self._lost)

    def log_once(self, key: tuple, level: int, message: str, *args: object) -> None:
        """Log a message the first time ``key`` is seen: a failing call must not flood the log."""
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.log(level, message, *args)
