"""A fake NVML with pynvml's function names, return types and exceptions.

Return values are pynvml's own ctypes structures (``c_nvmlUtilization_t``,
``c_nvmlMemory_v2_t``, ``c_nvmlFieldValue_t``, ``c_nvmlEventData_t`` …), handles are real
``c_nvmlDevice_t`` pointers, and errors are ``pynvml.NVMLError(code)`` (so the subclass is
e.g. ``NVMLError_GpuIsLost``), so the exporter runs the same code as against libnvidia-ml.
``test_fake_nvml.py`` checks every modelled function against pynvml's signature.

Faults, per device: ``errors[call] = code`` (raised on every call), ``delays[call] = s``
(a slow call), ``hangs[call] = threading.Event()`` (blocks until set), ``lost = True``
(every call answers GPU_IS_LOST). ``calls[call]`` counts what the exporter asked.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pynvml

NVMLError = pynvml.NVMLError

# Calls a MIG instance handle answers NOT_SUPPORTED on (board-level readings).
MIG_UNSUPPORTED = (
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPerformanceState",
    "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetProcessUtilization",
)


@dataclass
class FakeProcess:
    pid: int
    used_bytes: int
    gpu_instance: int = 0xFFFFFFFF
    compute_instance: int = 0xFFFFFFFF


@dataclass(eq=False)
class FakeGpu:
    name: str = "NVIDIA H200"
    uuid: str = ""
    bus_id: str = ""
    util_gpu: int = 50
    util_mem: int = 20
    mem_total: int = 141 * 2**30
    mem_used: int = 10 * 2**30
    mem_reserved: int = 512 * 2**20
    sm_mhz: int = 1980
    mem_mhz: int = 2619
    temp_c: int = 40
    mem_temp_c: int = 45
    power_mw: int = 120_000
    power_limit_mw: int = 700_000
    energy_mj: int = 5_000_000
    pstate: int = 0
    clock_reasons: int = 0
    ecc: tuple[int, int] = (0, 0)
    pcie_replays: int = 0
    pcie_kib_s: tuple[int, int] = (1000, 2000)
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    nvlink_kib: tuple[int, int] | None = None
    processes: list[FakeProcess] = field(default_factory=list)
    #: (pid, timestamp µs, sm %) samples, as NVML buffers them.
    proc_samples: list[tuple[int, int, int]] = field(default_factory=list)
    mig: list[FakeGpu] = field(default_factory=list)
    gi: int = 0
    ci: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    delays: dict[str, float] = field(default_factory=dict)
    hangs: dict[str, threading.Event] = field(default_factory=dict)
    lost: bool = False
    calls: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._buf = ctypes.c_int(0)  # a distinct address for the handle to point at
        self.handle = ctypes.cast(ctypes.pointer(self._buf), pynvml.c_nvmlDevice_t)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._buf)


class _EventSet:
    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.devices: set[int] = set()
        self.freed = False


class FakeNvml:
    """Stands in for the ``pynvml`` module."""

    def __init__(self, gpus: list[FakeGpu] | None = None, driver: str = "580.159") -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(), FakeGpu()]
        for i, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or f"GPU-{i:08d}-fake"
            gpu.bus_id = gpu.bus_id or f"00000000:{0x19 + i:02X}:00.0"
            for j, inst in enumerate(gpu.mig):
                inst.uuid = inst.uuid or f"MIG-{i}-{j}-fake"
                for call in MIG_UNSUPPORTED:
                    inst.errors.setdefault(call, pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.driver = driver
        self.init_error: int | None = None
        self.register_error: int | None = None
        self.wait_error: int | None = None
        self.initialized = False
        self.event_sets: list[_EventSet] = []
        self._by_address = {}
        for gpu in self.gpus:
            self._by_address[gpu.address] = gpu
            for inst in gpu.mig:
                self._by_address[inst.address] = inst

    # Constants the exporter reads from the module (everything else comes from pynvml too).
    def __getattr__(self, name: str):
        value = getattr(pynvml, name)
        if callable(value) and name.startswith("nvml"):
            raise AttributeError(f"the fake NVML does not model {name}")
        return value

    # --- plumbing -------------------------------------------------------------------
    def _gpu(self, handle, call: str) -> FakeGpu:
        if not self.initialized:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self._by_address[ctypes.cast(handle, ctypes.c_void_p).value]
        gpu.calls[call] += 1
        if gpu.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if call in gpu.hangs:
            gpu.hangs[call].wait()
        if call in gpu.delays:
            time.sleep(gpu.delays[call])  # models a slow NVML call, not a test waiting
        if call in gpu.errors:
            raise NVMLError(gpu.errors[call])
        return gpu

    def inject_xid(self, index: int, xid: int) -> None:
        """Deliver an XID event for GPU ``index`` to every event set it is registered in."""
        gpu = self.gpus[index]
        for es in self.event_sets:
            if gpu.address in es.devices:
                data = pynvml.c_nvmlEventData_t()
                data.device = gpu.handle
                data.eventType = pynvml.nvmlEventTypeXidCriticalError
                data.eventData = xid
                data.gpuInstanceId = 0xFFFFFFFF
                data.computeInstanceId = 0xFFFFFFFF
                es.queue.put(data)

    # --- library -------------------------------------------------------------------
    def nvmlInit(self):
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self):
        self.initialized = False

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlDeviceGetCount(self):
        if not self.initialized:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        gpu = self.gpus[index]
        if gpu.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu.handle

    # --- identity -------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle):
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle):
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetPciInfo(self, handle):
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()  # bytes, as in the real struct
        return info

    # --- fast readings ----------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(gpu=gpu.util_gpu, memory=gpu.util_mem)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        free = gpu.mem_total - gpu.mem_used - (gpu.mem_reserved if version else 0)
        if not version:
            return pynvml.c_nvmlMemory_t(total=gpu.mem_total, free=free, used=gpu.mem_used)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=gpu.mem_total, reserved=gpu.mem_reserved,
                                        free=free, used=gpu.mem_used)

    def nvmlDeviceGetClockInfo(self, handle, type):
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        return {pynvml.NVML_CLOCK_SM: gpu.sm_mhz, pynvml.NVML_CLOCK_MEM: gpu.mem_mhz}[type]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._gpu(handle, "nvmlDeviceGetTemperature").temp_c

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        known = {pynvml.NVML_FI_DEV_MEMORY_TEMP: gpu.mem_temp_c}
        if gpu.nvlink_kib is not None:
            known[pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX] = gpu.nvlink_kib[0]
            known[pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX] = gpu.nvlink_kib[1]
        for i, fid in enumerate(fieldIds):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            values[i].fieldId, values[i].scopeId = fid, scope
            values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if fid in known:
                values[i].value.ullVal = known[fid]
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetPerformanceState(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPerformanceState").pstate

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replays

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        return self._gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc[errorType]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_reasons

    # --- slow readings ----------------------------------------------------------------
    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetRemappedRows(self, device):
        return tuple(self._gpu(device, "nvmlDeviceGetRemappedRows").remapped)

    def nvmlDeviceGetPcieThroughput(self, device, counter):
        return self._gpu(device, "nvmlDeviceGetPcieThroughput").pcie_kib_s[counter]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_v2_t(
            pid=p.pid, usedGpuMemory=p.used_bytes, gpuInstanceId=p.gpu_instance,
            computeInstanceId=p.compute_instance)) for p in gpu.processes]

    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp):
        gpu = self._gpu(handle, "nvmlDeviceGetProcessUtilization")
        samples = [s for s in gpu.proc_samples if s[1] > timeStamp]
        if not samples:
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return [pynvml.c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=ts, smUtil=sm)
                for pid, ts, sm in samples]

    # --- MIG ----------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device):
        gpu = self._gpu(device, "nvmlDeviceGetMigMode")
        return [1, 1] if gpu.mig else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        self._gpu(device, "nvmlDeviceGetMaxMigDeviceCount")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        gpu = self._gpu(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        if index >= len(gpu.mig):
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return gpu.mig[index].handle

    def nvmlDeviceGetGpuInstanceId(self, device):
        return self._gpu(device, "nvmlDeviceGetGpuInstanceId").gi

    def nvmlDeviceGetComputeInstanceId(self, device):
        return self._gpu(device, "nvmlDeviceGetComputeInstanceId").ci

    # --- events ---------------------------------------------------------------------------
    def nvmlEventSetCreate(self):
        es = _EventSet()
        self.event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        if self.register_error is not None:
            raise NVMLError(self.register_error)
        eventSet.devices.add(gpu.address)

    def nvmlEventSetWait(self, eventSet, timeoutms):
        if self.wait_error is not None:
            raise NVMLError(self.wait_error)
        try:
            return eventSet.queue.get(timeout=timeoutms / 1000.0)
        except queue.Empty:
            raise NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, eventSet):
        eventSet.freed = True
