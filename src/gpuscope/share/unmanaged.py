"""Processes on the GPU that never joined the controller: they run outside every share and cap.

The preload library enforces shares and caps only in processes that load it; a tenant can unset
``LD_PRELOAD``, and a process started by hand without it is not held at all. What gives them away is
the driver: NVML lists every process with a context on the GPU. A thread of its own samples that
list (never the controller's loop: an NVML call can stall) and keeps those whose pids never joined.
A process is reported once it is seen without having joined in two samples in a row (a tenant joins
within milliseconds of creating its context, at its first allocation or launch), and logged once.

Each sample is an NVML call into the driver, at four a second by default the controller's most
frequent work that the CPU host does not show (docs/share.md, "Security model"). So while the list
stays the same the watch looks less often, up to ``BACKOFF`` times its interval, and at a change (a
process came or went, one not joined) it looks again at its interval: a process that never joins is
then reported within ``BACKOFF + 1`` intervals of its first appearance on the GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Collection, Mapping

#: pid -> bytes of device memory it uses, for every process with a compute context on the GPU.
ProcessSource = Callable[[], Mapping[int, int]]

#: The longest interval between samples while the GPU's processes stay the same, in intervals.
BACKOFF = 4


def nvml_processes(index: int) -> ProcessSource:
    """NVML's running compute processes on GPU ``index``."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read() -> dict[int, int]:
        return {p.pid: int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}

    return read


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read(200).replace(b"\0", b" ").decode(errors="replace").strip() or "?"
    return "?"


class UnmanagedWatch:
    """Samples ``source`` in a thread, every ``interval_s`` after a change and up to ``BACKOFF``
    times less often while nothing changes; ``joined()`` the pids that joined."""

    def __init__(self, source: ProcessSource, joined: Callable[[], Collection[int]], *,
                 interval_s: float = 0.5, log: Callable[[str], None] | None = None,
                 also: Callable[[], None] | None = None) -> None:
        self.source = source
        self.also = also  # another NVML look to take in the same thread at each sample
        self.joined = joined
        self.base_interval_s = interval_s
        self.interval_s = interval_s  # until the next sample: doubles while the GPU's processes stay put
        self.log = log or (lambda line: None)
        self.unmanaged: dict[int, int] = {}  # pid -> bytes, as of the last sample
        self.samples = self.errors = 0
        self._suspects: set[int] = set()  # unjoined in the last sample: reported if again in the next
        self._last_pids: frozenset[int] | None = None  # the GPU's processes at the last sample
        self._logged: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuscope-share-unmanaged", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def sample(self) -> None:
        """One look at the GPU's processes (the thread calls it; tests call it directly)."""
        try:
            on_gpu = dict(self.source())
        except Exception as exc:  # NVML gone or failing: counted, logged once, never fatal
            self.errors += 1
            if self.errors == 1:
                self.log(f"gpuscope share: cannot list the GPU's processes ({exc}): processes outside the "
                         "ledger go unseen until it works again")
            return
        self.samples += 1
        joined = set(self.joined()) | {os.getpid()}
        unjoined = {pid for pid in on_gpu if pid not in joined}
        reported = unjoined & self._suspects
        self._suspects = unjoined
        self._back_off(frozenset(on_gpu), settled=unjoined == reported)  # none seen once only
        self.unmanaged = {pid: on_gpu[pid] for pid in reported}
        for pid in sorted(reported - self._logged):
            if len(self._logged) < 1024:
                self._logged.add(pid)
                self.log(f"gpuscope share: pid {pid} ({command_line(pid)}) uses the GPU "
                         f"({on_gpu[pid] / 2**20:.0f} MiB) without joining: it runs outside every share "
                         "and cap")

    def _back_off(self, pids: frozenset[int], *, settled: bool) -> None:
        """The interval until the next sample: doubled (up to ``BACKOFF`` intervals) when the GPU's
        processes are the ones of the last sample and none is to be seen again before it is reported;
        else the interval itself."""
        unchanged = settled and pids == self._last_pids
        self._last_pids = pids
        longest = self.base_interval_s * BACKOFF
        self.interval_s = min(2 * self.interval_s, longest) if unchanged else self.base_interval_s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
            if self.also is not None:
                try:
                    self.also()
                except Exception as exc:  # counted with the rest, never fatal to the thread
                    self.errors += 1
                    if self.errors == 1:
                        self.log(f"gpuscope share: an NVML check failed ({exc})")
