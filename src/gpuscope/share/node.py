"""One ``gpuscope share`` for every GPU of a node: a controller per GPU behind one join socket.

Each GPU has its own ledger (policy, bell and tenant pages: ``ledger.Policy``) and its own loop
(``controller.Controller``), with its own tenants' shares and memory caps (a policy file may give a
GPU shares of its own: ``policy.py``). They share what the ledger prefix names on the filesystem, the
lock and the join socket (``ledger.LedgerFiles``): a process that joins names the GPU its context
runs on (the UUID in its hello), and joins that GPU's ledger; a process that uses two GPUs joins
both, and each GPU's gate holds its launches there. Gang tenants are held as one on all their GPUs
(``gangs.py``).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable

from gpuscope.share.access import Access
from gpuscope.share.controller import DEFAULTS, POLICY_CHECK_S, Controller, UtilizationSource
from gpuscope.share.gangs import Gangs
from gpuscope.share.gpus import Gpu
from gpuscope.share.ledger import LedgerFiles
from gpuscope.share.policy import PolicyFile, PolicySpec
from gpuscope.share.settings import ShareSettings


class Node:
    """The controllers of a node's GPUs (``gpus``, in order), the policy file they share, and the
    threads that run them."""

    def __init__(self, prefix: str, gpus: list[Gpu], spec: PolicySpec, settings: ShareSettings = DEFAULTS, *,
                 utilization: Callable[[Gpu], UtilizationSource | None] | None = None,
                 policy_file: PolicyFile | None = None, log: Callable[[str], None] | None = None) -> None:
        if not gpus:
            raise ValueError("no GPU to hold")
        self.log = log or (lambda line: sys.stderr.write(line + "\n"))
        spec.check_gpus(gpus)
        self.gpus = list(gpus)
        self.policy_file = policy_file
        self.reload_now = False  # set by SIGHUP (request_reload): reread the policy file now
        # wakes the thread that looks at the policy file (run): a pipe, since a signal handler writes
        # it (an Event's lock, taken in a handler that interrupted its holder, would deadlock)
        self._nudge_r, self._nudge_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.policy_reloads = {"applied": 0, "refused": 0}
        self.files = LedgerFiles(prefix, log=self.log)
        self.controllers: list[Controller] = []
        try:
            for gpu in gpus:
                self.controllers.append(Controller(
                    prefix, spec.for_gpu(gpu), settings, access=Access(spec.allow), log=self.log,
                    files=self.files, gpu=gpu, utilization=utilization(gpu) if utilization else None))
        except BaseException:
            self.close()
            raise
        if len(self.controllers) > 1:  # gangs span GPUs: one GPU has none to align
            gangs = Gangs(self.controllers)
            for c in self.controllers:
                c.gangs = gangs
        self.files.start()

    # --- what /metrics and the NVML checks read ------------------------------------------------
    @property
    def joins(self) -> dict[str, int]:
        return dict(self.files.joins.results)

    def joined_pids(self) -> list[int]:
        return sorted({pid for c in self.controllers for pid in c.joined_pids()})

    def tenants_by_pid(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for c in self.controllers:
            out.update(c.tenants_by_pid())
        return out

    def charged_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.controllers:
            for name, seconds in c.charged_seconds().items():
                out[name] = out.get(name, 0.0) + seconds
        return out

    # --- the policy file, for every GPU at once ----------------------------------------------
    def apply_policy(self, spec: PolicySpec) -> None:
        """Every GPU's tenants from ``spec``: all or none (ValueError, changing nothing)."""
        spec.check_gpus(self.gpus)
        for c in self.controllers:
            c.merged_tenants(spec.on_gpu(c.gpu))
        for c in self.controllers:
            c.apply_policy(spec.on_gpu(c.gpu))

    def check_policy_file(self) -> None:
        if self.policy_file is None:
            return
        forced, self.reload_now = self.reload_now, False
        if not (forced or self.policy_file.changed()):
            return
        try:
            self.apply_policy(self.policy_file.read())
        except ValueError as exc:
            self.policy_reloads["refused"] += 1
            self.log(f"gpuscope share: {self.policy_file.path} refused: {exc}; the policy in force stays")
            return
        self.policy_reloads["applied"] += 1
        parts = []
        for c in self.controllers:
            shares = ", ".join(f"{t.name}={t.share:g}" for t in c.tenants if t.share > 0)
            parts.append(shares if len(self.controllers) == 1 else f"GPU {c.gpu.name}: {shares}")
        self.log(f"gpuscope share: {self.policy_file.path} applied: {'; '.join(parts)}")

    # --- running --------------------------------------------------------------------------------
    def request_reload(self) -> None:
        """Reread the policy file now, changed or not (SIGHUP)."""
        self.reload_now = True
        self.nudge()

    def nudge(self) -> None:
        """Wake the thread in ``run`` now: a reload was asked for, or ``stop`` was set."""
        with contextlib.suppress(BlockingIOError):  # full: it is woken anyway
            os.write(self._nudge_w, b"\0")

    def _sleep(self, seconds: float) -> None:
        """Until ``seconds`` have passed or ``nudge`` was called."""
        ready, _, _ = select.select([self._nudge_r], [], [], max(0.0, seconds))
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._nudge_r, 4096)

    def run(self, stop: threading.Event) -> None:
        """Each GPU's loop in a thread of its own; this one looks at the policy file every
        POLICY_CHECK_S, and at once when nudged. It sleeps in between: looking every 50 ms whether a
        reload was asked for cost an idle controller 20 wake-ups a second (0.14% of a core on the CPU
        host), for a file looked at twice a second."""
        loops = [threading.Thread(target=c.run, args=(stop,), name=f"gpuscope-share-gpu{c.gpu.name}",
                                  daemon=True) for c in self.controllers]
        for t in loops:
            t.start()
        last = time.monotonic()
        while not stop.is_set():
            self._sleep(last + POLICY_CHECK_S - time.monotonic())
            now = time.monotonic()
            if self.reload_now or now - last >= POLICY_CHECK_S:
                last = now
                self.check_policy_file()
        for t in loops:
            t.join()

    def close(self) -> None:
        for c in self.controllers:
            c.close()
        self.files.close()
        for fd in (self._nudge_r, self._nudge_w):
            with contextlib.suppress(OSError):  # closed already
                os.close(fd)
        self._nudge_r = self._nudge_w = -1
