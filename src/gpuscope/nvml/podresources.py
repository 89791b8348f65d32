"""Which Kubernetes container each GPU is allocated to, from the kubelet's PodResources API.

This is what dcgm-exporter's Kubernetes mode does: ask the kubelet's ``v1.PodResourcesLister/List``
(gRPC over the unix socket ``/var/lib/kubelet/pod-resources/kubelet.sock``) which devices of the
NVIDIA device plugin's resources each container holds, and map them by device id, which is the
GPU's UUID (``GPU-…``) or the MIG instance's (``MIG-…``), to the devices NVML reports. Resources
taken: ``nvidia.com/gpu`` and the mixed-strategy MIG resources ``nvidia.com/mig-*``. Device-plugin
time-slicing replicas (``<uuid>::<n>``) count as their GPU; ids that are plain indices (the plugin's
``deviceIDStrategy: index``) match a whole GPU's ``gpu`` label.

A GPU allocated to exactly one container gets that container's ``namespace``, ``pod`` and
``container``; a GPU shared by several containers (time-slicing) gets none: its device-level
values cannot be split between them, and copying them onto each would count them several times
(dcgm-exporter #587). ``gpuscope.nvml.collectors.PodLabelled`` appends the labels.

The call never runs on the scrape path, nor on a sampler's: a thread refreshes a cached map every
``interval`` with a ``timeout``; lookups read the map. Failure is never fatal: with the socket
absent, the kubelet down, ``grpcio`` missing or the call timing out, series carry empty pod labels,
the outage is counted once in ``gpuscope_exporter_errors_total{call="PodResourcesLister/List"}``
and logged once, and the next interval tries again. A map older than ``max_age`` is dropped rather
than served (pods come and go); a shorter outage keeps the last one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from gpuscope.nvml.devices import Device
from gpuscope.nvml.health import Health

log = logging.getLogger("gpuscope.exporter")

#: Where the kubelet serves the PodResources API (kubelet's ``--root-dir`` /var/lib/kubelet).
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
#: Separator of the NVIDIA device plugin's time-slicing replica ids: ``<uuid>::<replica>``.
REPLICA_SEPARATOR = "::"
#: The ``call`` label of the error counter.
CALL = "PodResourcesLister/List"
#: The kubelet's answers are small; a node with many pods still fits well inside this.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

Owner = tuple[str, str, str]  # (namespace, pod, container)


def is_gpu_resource(name: str) -> bool:
    return name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX)


def device_owners(pod_resources: Iterable[Any]) -> dict[str, Owner | None]:
    """Device id → the one container holding it, or None when several do (from ``List``'s
    ``pod_resources``; each item has ``name``, ``namespace`` and ``containers``)."""
    holders: dict[str, set[Owner]] = {}
    for pod in pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if not is_gpu_resource(devices.resource_name):
                    continue
                for device_id in devices.device_ids:
                    gpu = device_id.split(REPLICA_SEPARATOR, 1)[0]
                    holders.setdefault(gpu, set()).add((pod.namespace, pod.name, container.name))
    return {gpu: next(iter(owners)) if len(owners) == 1 else None for gpu, owners in holders.items()}


class PodResourcesWatcher:
    """Keeps a cached device → container map, refreshed from the kubelet on a background thread."""

    def __init__(self, socket_path: str, health: Health, interval: float = 10.0, timeout: float = 5.0,
                 max_age: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.health = health
        self.interval = interval
        self.timeout = timeout
        self.max_age = max_age if max_age is not None else 3 * interval
        self.clock = clock
        self._owners: dict[str, Owner | None] = {}
        self._last_success: float | None = None
        self._failing = False  # in an outage that was already counted and logged
        self._channel: Any = None
        self._stub: Any = None
        self._messages: Any = None  # the generated api_pb2 module, imported with grpc by _connect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuscope-podresources", daemon=True)
        #: Refreshes tried, and those that succeeded (tests wait on them).
        self.attempts = 0
        self.refreshes = 0

    # --- lookups (sampler lanes) ---------------------------------------------------------------------
    def owner(self, device: Device) -> Owner | None:
        """The container ``device`` is allocated to, or None (none, several, or not known now)."""
        owners = self._owners  # one reference read: the map is replaced whole, never changed
        found = owners.get(device.uuid) if device.uuid else None
        if found is None and not device.is_mig:
            found = owners.get(device.label)  # deviceIDStrategy: index
        return found

    # --- the refresh thread --------------------------------------------------------------------------
    def start(self) -> PodResourcesWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Wait for the thread (if started) and close the channel."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        self._close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.refresh() and self._stub is False:
                return  # grpcio is not installed: nothing will change by retrying
            self._stop.wait(self.interval)

    def refresh(self) -> bool:
        """One ``List`` call; True when the map was replaced with the kubelet's answer."""
        self.attempts += 1
        try:
            stub = self._connect()
            if stub is None:
                raise FileNotFoundError(f"no socket at {self.socket_path}")
            response = stub.List(self._messages.ListPodResourcesRequest(), timeout=self.timeout)
            owners = device_owners(response.pod_resources)
        except Exception as exc:  # grpc.RpcError, OSError, a malformed answer: never fatal
            self._failed(exc)
            return False
        self._owners = owners
        self._last_success = self.clock()
        self.refreshes += 1
        if self._failing:
            log.info("kubelet PodResources API at %s answers again: %d GPU allocation(s)",
                     self.socket_path, len(owners))
            self._failing = False
        return True

    def _connect(self) -> Any:
        if self._stub is not None:
            return self._stub
        try:
            import grpc

            from gpuscope.nvml.podresources_v1 import api_pb2, api_pb2_grpc
        except ImportError as exc:
            self._stub = False
            raise RuntimeError(f"grpcio/protobuf not installed ({exc}); "
                               "pip install 'gpuscope[kubernetes]'") from None
        self._messages = api_pb2
        if not os.path.exists(self.socket_path):
            return None
        self._channel = grpc.insecure_channel(
            f"unix://{self.socket_path}",
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def _failed(self, exc: BaseException) -> None:
        if self._stub is not False:
            self._close()  # a fresh channel next time: no inherited reconnect backoff
        stale = self._last_success is None or self.clock() - self._last_success > self.max_age
        if stale:
            self._owners = {}
        if self._failing:
            return
        self._failing = True
        self.health.count_error(CALL)
        log.warning("kubelet PodResources API at %s unavailable (%s): GPU series carry no pod labels "
                    "until it answers; retrying every %.3gs", self.socket_path, _reason(exc), self.interval)

    def _close(self) -> None:
        channel, self._channel = self._channel, None
        if self._stub is not False:
            self._stub = None
        if channel is not None:
            channel.close()


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.RpcError
        details = getattr(exc, "details", lambda: "")()
        return f"{code()}: {details}" if details else str(code())
    return str(exc) or type(exc).__name__
