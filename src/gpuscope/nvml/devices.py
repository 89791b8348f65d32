"""GPU discovery and the ``gpu`` label scheme.

Labels: a plain GPU is its NVML index (``"0"``). A MIG instance is
``"<parent index>/gi<GPU instance id>/ci<compute instance id>"`` (``"0/gi1/ci0"``), so
``gpu=~"0/.*"`` selects every instance on GPU 0. A GPU with MIG enabled keeps its own label
for the board-level readings (temperature, power, clocks); its instances carry memory and
processes. Identity (uuid, name, PCI bus id, driver, MIG parent) is only on ``gpuscope_gpu_info``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from gpuscope.nvml.api import NVMLError, error_code, error_text, handle_key, text
from gpuscope.nvml.health import Health

log = logging.getLogger("gpuscope.exporter")


@dataclass(eq=False)
class Device:
    """One GPU or MIG instance the exporter samples."""

    label: str
    handle: Any
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    mig_parent: str = ""
    #: Calls (or call variants) this device answered NOT_SUPPORTED: never asked again.
    unsupported: set[str] = field(default_factory=set)

    @property
    def is_mig(self) -> bool:
        return bool(self.mig_parent)

    @property
    def key(self) -> int:
        return handle_key(self.handle)


def _safe(health: Health, label: str, fn: Any, *args: Any, default: Any = "") -> Any:
    """Identity calls at startup: a failure costs one field, counted, never the whole device."""
    try:
        return fn(*args)
    except NVMLError as exc:
        health.count_error(fn.__name__)
        health.log_once((fn.__name__, label, error_code(exc)), logging.WARNING,
                        "gpu %s: %s failed: %s", label, fn.__name__, error_text(exc))
        return default


def _mig_instances(nv: Any, parent: Device, health: Health) -> list[Device]:
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(parent.handle)
    except NVMLError:
        return []  # pre-Ampere GPUs and most consumer boards: no MIG, not an error
    if current != nv.NVML_DEVICE_MIG_ENABLE:
        return []
    instances = []
    count = _safe(health, parent.label, nv.nvmlDeviceGetMaxMigDeviceCount, parent.handle, default=0)
    for slot in range(count):
        try:
            handle = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent.handle, slot)
        except NVMLError:
            continue  # empty slot: NVML answers NOT_FOUND
        gi = _safe(health, parent.label, nv.nvmlDeviceGetGpuInstanceId, handle, default=slot)
        ci = _safe(health, parent.label, nv.nvmlDeviceGetComputeInstanceId, handle, default=0)
        instances.append(Device(
            label=f"{parent.label}/gi{gi}/ci{ci}", handle=handle,
            uuid=text(_safe(health, parent.label, nv.nvmlDeviceGetUUID, handle)),
            name=text(_safe(health, parent.label, nv.nvmlDeviceGetName, handle)) or parent.name,
            pci_bus_id=parent.pci_bus_id, mig_parent=parent.label,
        ))
    return instances


def discover(nv: Any, health: Health) -> list[Device]:
    """Every GPU NVML reports, followed by its MIG instances; [] when none answer."""
    try:
        count = nv.nvmlDeviceGetCount()
    except NVMLError as exc:
        health.count_error("nvmlDeviceGetCount")
        log.warning("NVML could not count GPUs (%s): serving exporter health only", error_text(exc))
        return []
    devices: list[Device] = []
    for index in range(count):
        label = str(index)
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except NVMLError as exc:
            # A GPU already off the bus at startup: count it, keep the others.
            health.count_error("nvmlDeviceGetHandleByIndex")
            if error_code(exc) == nv.NVML_ERROR_GPU_IS_LOST and health.mark_lost(label):
                log.error("gpu %s is lost (fell off the bus) at startup", label)
            else:
                log.warning("gpu %s: no handle: %s", label, error_text(exc))
            continue
        pci = _safe(health, label, nv.nvmlDeviceGetPciInfo, handle, default=None)
        gpu = Device(
            label=label, handle=handle,
            uuid=text(_safe(health, label, nv.nvmlDeviceGetUUID, handle)),
            name=text(_safe(health, label, nv.nvmlDeviceGetName, handle)),
            pci_bus_id=text(pci.busId) if pci is not None else "",
        )
        devices.append(gpu)
        devices.extend(_mig_instances(nv, gpu, health))
    return devices
