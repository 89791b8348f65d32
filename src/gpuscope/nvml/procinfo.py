"""Process name and container id of a PID, from ``/proc`` (what NVML does not say).

The container id is the 64-hex id that docker, containerd, CRI-O and podman put in the
process's cgroup path, in every layout seen in practice::

    12:memory:/docker/<id>                                                 (cgroup v1, docker)
    0::/system.slice/docker-<id>.scope                                    (cgroup v2, docker)
    0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope
    11:cpuset:/kubepods/besteffort/pod<uid>/<id>                          (cgroup v1, kubelet)
    0::/machine.slice/libpod-<id>.scope                                   (podman)
    0::/kubepods.slice/.../crio-<id>.scope                                (CRI-O)

The last such id on the line wins (a pod's cgroup nests the container inside the pod).
Processes outside a container get ``""``. An exporter in a container sees host PIDs only with
``pid: host``; otherwise names and ids are empty (memory and utilization still come from NVML).
"""

from __future__ import annotations

import re

_CONTAINER_ID = re.compile(r"(?<![0-9a-f])([0-9a-f]{64})(?![0-9a-f])")


def container_id(cgroup_text: str) -> str:
    """Container id from the text of ``/proc/<pid>/cgroup``, or ``""`` outside containers."""
    found = ""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        ids = _CONTAINER_ID.findall(path)
        if ids:
            found = ids[-1]
    return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # the process exited, or is in another PID namespace
        return ""


class ProcessNames:
    """Caches (name, container id) per PID while the PID stays on the GPU."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._cache: dict[int, tuple[str, str]] = {}

    def lookup(self, pid: int) -> tuple[str, str]:
        hit = self._cache.get(pid)
        if hit is None:
            comm = _read(f"{self.proc_root}/{pid}/comm").strip()
            hit = (comm, container_id(_read(f"{self.proc_root}/{pid}/cgroup")))
            if comm:  # cache only what was found, so a racing read is retried next round
                self._cache[pid] = hit
        return hit

    def forget_except(self, pids: set[int]) -> None:
        """Drop PIDs that left the GPU, so a reused PID is looked up afresh."""
        for pid in [p for p in self._cache if p not in pids]:
            del self._cache[pid]
