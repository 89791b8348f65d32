"""A worker thread that runs one job at a time, so its caller can stop waiting on a wedged NVML call.

A ctypes call into NVML cannot be interrupted. The sampler hands each device's round to that
device's lane and waits at most ``--nvml.call-timeout``; if the call hangs, the lane stays busy
(the sampler skips it, and its values go stale) until NVML returns. Lanes are daemon threads,
so a call that never returns cannot block the exporter's exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class LaneStopped(Exception):
    """The lane was stopped before it ran the job."""


class Lane:
    """One daemon thread; :meth:`run` submits a job and waits for it with a timeout."""

    def __init__(self, name: str) -> None:
        self._job: Callable[[], Any] | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._wake = threading.Event()
        self._done = threading.Event()
        self._stopping = False
        #: Set by the sampler once it has counted this job's hang; cleared for each new job.
        self.hang_reported = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """True while a job (perhaps one abandoned after its timeout) is still running."""
        return self._job is not None

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def run(self, job: Callable[[], Any], timeout: float) -> tuple[bool, Any, BaseException | None]:
        """(finished, result, exception); (False, None, None) if ``job`` outlived ``timeout``."""
        if self.busy or self._stopping:
            return False, None, None
        self._result, self._error = None, None
        self._done.clear()
        self.hang_reported = False
        self._job = job
        self._wake.set()
        if not self._done.wait(timeout):
            return False, None, None
        return True, self._result, self._error

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                # A job submitted as stop() arrived is never run: release its waiter now.
                self._error = LaneStopped()
                self._job = None
                self._done.set()
                return
            job = self._job
            if job is None:
                continue
            try:
                self._result = job()
            except BaseException as exc:  # handed to the sampler, which counts and logs it
                self._error = exc
            finally:
                self._job = None
                self._done.set()
