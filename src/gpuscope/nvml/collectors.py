"""What each collector asks NVML for one device, turned into samples.

A collector is one source of metrics with one cadence and one thread (see ``sampler.py``).
``sample(device)`` runs on that collector's own lane thread, so per-device state kept here
(throttle integration, process-utilization timestamps) is touched by one thread only.
Units are converted to base units here: MHz → Hz, mW → W, mJ → J, KiB → bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import pynvml

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.api import INVALID_ID, NOT_FOUND
from gpuscope.nvml.calls import Calls
from gpuscope.nvml.devices import Device
from gpuscope.nvml.procinfo import ProcessNames
from gpuscope.nvml.registry import register_collector


class Sample(NamedTuple):
    metric: cat.Metric
    labels: tuple[str, ...]
    value: float


#: Clock event (throttle) reasons by NVML bit; the label value is the reason's NVML name in snake case.
CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
_FIELD_OK = pynvml.NVML_SUCCESS
# nvidia-ml-py before 11.510 has no v2 memory struct (no "reserved" figure).
_MEMORY_V2 = getattr(pynvml, "nvmlMemory_v2", None)


def _field_value(field: Any) -> float | None:
    """Value of one ``nvmlFieldValue_t``, or None when NVML flagged it (per-field return code)."""
    if field.nvmlReturn != _FIELD_OK:
        return None
    kind = field.valueType
    v = field.value
    return float({
        pynvml.NVML_VALUE_TYPE_DOUBLE: lambda: v.dVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: lambda: v.uiVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: lambda: v.ulVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: lambda: v.ullVal,
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: lambda: v.sllVal,
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: lambda: v.siVal,
    }.get(kind, lambda: v.ullVal)())


class Collector(ABC):
    """Base: a named source with a cadence; subclasses implement :meth:`sample`."""

    name = ""
    #: True: runs at ``--sampling.slow-interval`` (expensive calls); False: ``--sampling.interval``.
    slow = False
    #: True when the collector makes sense on MIG instances (most board-level readings do not).
    on_mig = False

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    @classmethod
    def build(cls, calls: Calls, config: Any, proc_root: str) -> Collector:
        """The collector for an exporter's ``config`` (a ``nvml.config.Config``)."""
        return cls(calls)

    def applies(self, device: Device) -> bool:
        return self.on_mig or not device.is_mig

    @abstractmethod
    def sample(self, device: Device) -> list[Sample]:
        """This collector's readings of one device."""


@register_collector("device", default=True,
                    help="utilization, memory, clocks, temperatures, power, P-state, PCIe replays, ECC")
class DeviceCollector(Collector):
    """Cheap per-GPU readings, every fast interval (what each call costs: docs/design.md, "NVML and
    nvidia-smi").

    Exposes, for example::

        gpuscope_gpu_utilization_ratio{gpu="0"} 0.97
        gpuscope_gpu_memory_used_bytes{gpu="0"} 8.1e+10
        gpuscope_gpu_power_watts{gpu="0"} 412.3
    """

    on_mig = True  # memory info answers per MIG instance; the rest drop out as NOT_SUPPORTED

    def sample(self, device: Device) -> list[Sample]:
        c, g, out = self.calls, (device.label,), []
        util = c.call(device, "nvmlDeviceGetUtilizationRates")
        if util is not None:
            out += [Sample(cat.GPU_UTILIZATION, g, util.gpu / 100.0),
                    Sample(cat.GPU_MEMORY_UTILIZATION, g, util.memory / 100.0)]
        mem = None
        if _MEMORY_V2 is not None:
            mem = c.call(device, "nvmlDeviceGetMemoryInfo", _MEMORY_V2, variant="memory_v2")
        if mem is None and (_MEMORY_V2 is None or "memory_v2" in device.unsupported):
            mem = c.call(device, "nvmlDeviceGetMemoryInfo")  # older drivers: no reserved figure
        if mem is not None:
            out += [Sample(cat.GPU_MEMORY_USED, g, float(mem.used)),
                    Sample(cat.GPU_MEMORY_FREE, g, float(mem.free)),
                    Sample(cat.GPU_MEMORY_TOTAL, g, float(mem.total))]
            if hasattr(mem, "reserved"):
                out.append(Sample(cat.GPU_MEMORY_RESERVED, g, float(mem.reserved)))
        for metric, clock, variant in ((cat.GPU_SM_CLOCK, pynvml.NVML_CLOCK_SM, "clock_sm"),
                                       (cat.GPU_MEMORY_CLOCK, pynvml.NVML_CLOCK_MEM, "clock_mem")):
            mhz = c.call(device, "nvmlDeviceGetClockInfo", clock, variant=variant)
            if mhz is not None:
                out.append(Sample(metric, g, mhz * 1e6))
        temp = c.call(device, "nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU)
        if temp is not None:
            out.append(Sample(cat.GPU_TEMPERATURE, g, float(temp)))
        fields = c.call(device, "nvmlDeviceGetFieldValues", [pynvml.NVML_FI_DEV_MEMORY_TEMP],
                        variant="memory_temperature")
        if fields:
            value = _field_value(fields[0])
            if value is None:
                device.unsupported.add("memory_temperature")  # per-field NOT_SUPPORTED
            elif value > 0:  # boards without an HBM sensor report 0
                out.append(Sample(cat.GPU_MEMORY_TEMPERATURE, g, value))
        for metric, name in ((cat.GPU_POWER, "nvmlDeviceGetPowerUsage"),
                             (cat.GPU_POWER_LIMIT, "nvmlDeviceGetEnforcedPowerLimit")):
            milliwatts = c.call(device, name)
            if milliwatts is not None:
                out.append(Sample(metric, g, milliwatts / 1000.0))
        pstate = c.call(device, "nvmlDeviceGetPerformanceState")
        if pstate is not None and 0 <= pstate <= 15:  # 32 = unknown
            out.append(Sample(cat.GPU_PSTATE, g, float(pstate)))
        replays = c.call(device, "nvmlDeviceGetPcieReplayCounter")
        if replays is not None:
            out.append(Sample(cat.GPU_PCIE_REPLAY, g, float(replays)))
        for kind, code in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                           ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            # Volatile counters: since the driver loaded, as the metric's help says.
            errors = c.call(device, "nvmlDeviceGetTotalEccErrors", code, pynvml.NVML_VOLATILE_ECC,
                            variant=f"ecc_{kind}")
            if errors is not None:
                out.append(Sample(cat.GPU_ECC_ERRORS, (device.label, kind), float(errors)))
        return out


@register_collector("clock_events", default=True,
                    help="clock event (throttle) reasons, 0/1 and seconds active")
class ClockEventCollector(Collector):
    """Clock event (throttle) reasons: a 0/1 series per reason, and seconds active per reason.

    Seconds are integrated over sample intervals: the interval from one sample to the next is
    credited to the reasons active at its start; a gap longer than ``max_gap`` (a hung call,
    a suspended host) is not credited, since nothing is known about it::

        gpuscope_gpu_clock_event_active{gpu="0",reason="sw_thermal_slowdown"} 1
        gpuscope_gpu_clock_event_seconds_total{gpu="0",reason="sw_thermal_slowdown"} 10.0
    """


    @classmethod
    def build(cls, calls: Calls, config: Any, proc_root: str) -> Collector:
        # Throttle seconds are credited only across gaps up to 2.5 intervals (see the docstring).
        return cls(calls, max_gap=2.5 * config.interval)

    def __init__(self, calls: Calls, max_gap: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(calls)
        self.max_gap = max_gap
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}
        self._seconds: dict[str, dict[str, float]] = {}

    def sample(self, device: Device) -> list[Sample]:
        mask = self.calls.first(device, ("nvmlDeviceGetCurrentClocksEventReasons",
                                         "nvmlDeviceGetCurrentClocksThrottleReasons"))
        now = self.clock()
        seconds = self._seconds.setdefault(device.label, {r: 0.0 for r, _ in CLOCK_EVENT_REASONS})
        previous = self._last.get(device.label)
        if mask is None:
            self._last.pop(device.label, None)  # unknown state: do not credit the next interval
            return [Sample(cat.GPU_CLOCK_EVENT_SECONDS, (device.label, r), s) for r, s in seconds.items()]
        if previous is not None and 0 < now - previous[0] <= self.max_gap:
            for reason, bit in CLOCK_EVENT_REASONS:
                if previous[1] & bit:
                    seconds[reason] += now - previous[0]
        self._last[device.label] = (now, mask)
        out = [Sample(cat.GPU_CLOCK_EVENT_ACTIVE, (device.label, r), 1.0 if mask & bit else 0.0)
               for r, bit in CLOCK_EVENT_REASONS]
        out += [Sample(cat.GPU_CLOCK_EVENT_SECONDS, (device.label, r), s) for r, s in seconds.items()]
        return out


@register_collector("energy", default=True,
                    help="total energy counter (3.4 ms per call: slow cadence)")
class EnergyCollector(Collector):
    """Total energy since the driver loaded, on the slow cadence: the call is one of NVML's slowest
    (docs/design.md, "NVML and nvidia-smi")::

        gpuscope_gpu_energy_joules_total{gpu="0"} 1.2e+06
    """

    slow = True

    def sample(self, device: Device) -> list[Sample]:
        millijoules = self.calls.call(device, "nvmlDeviceGetTotalEnergyConsumption")
        return [] if millijoules is None else [Sample(cat.GPU_ENERGY, (device.label,), millijoules / 1000.0)]


@register_collector("remapped_rows", default=True,
                    help="HBM row remapping state (slow cadence)")
class RemappedRowsCollector(Collector):
    """Row remapping (HBM repair) state; changes rarely, so slow cadence::

        gpuscope_gpu_remapped_rows{cause="uncorrectable",gpu="0"} 0
    """

    slow = True

    def sample(self, device: Device) -> list[Sample]:
        rows = self.calls.call(device, "nvmlDeviceGetRemappedRows")
        if rows is None:
            return []
        causes = ("correctable", "uncorrectable", "pending", "failed")
        return [Sample(cat.GPU_REMAPPED_ROWS, (device.label, cause), float(v))
                for cause, v in zip(causes, rows, strict=False)]


@register_collector("nvlink", default=True,
                    help="NVLink bytes, where present (slow cadence)")
class NvlinkCollector(Collector):
    """NVLink data bytes summed over all links (field values, scope UINT_MAX = all links)::

        gpuscope_gpu_nvlink_bytes_total{direction="tx",gpu="0"} 3.2e+12
    """

    slow = True
    _FIELDS = (("tx", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX),
               ("rx", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX))

    def sample(self, device: Device) -> list[Sample]:
        fields = self.calls.call(device, "nvmlDeviceGetFieldValues",
                                 [(fid, INVALID_ID) for _, fid in self._FIELDS], variant="nvlink")
        if not fields:
            return []
        out = []
        for (direction, _), field in zip(self._FIELDS, fields, strict=False):
            kib = _field_value(field)
            if kib is not None:
                out.append(Sample(cat.GPU_NVLINK_BYTES, (device.label, direction), kib * 1024.0))
        if not out:
            device.unsupported.add("nvlink")  # no NVLink on this board: stop asking
        return out


@register_collector("pcie_throughput", default=False,
                    help="PCIe TX/RX throughput (NVML samples 20 ms per direction; slow cadence)")
class PcieThroughputCollector(Collector):
    """PCIe throughput, which NVML measures by sampling 20 ms per direction: opt-in, slow cadence::

        gpuscope_gpu_pcie_throughput_bytes_per_second{direction="rx",gpu="0"} 1.5e+09
    """

    slow = True

    def sample(self, device: Device) -> list[Sample]:
        out = []
        directions = (("tx", pynvml.NVML_PCIE_UTIL_TX_BYTES), ("rx", pynvml.NVML_PCIE_UTIL_RX_BYTES))
        for direction, counter in directions:
            kib_per_s = self.calls.call(device, "nvmlDeviceGetPcieThroughput", counter,
                                        variant=f"pcie_{direction}")
            if kib_per_s is not None:
                out.append(Sample(cat.GPU_PCIE_THROUGHPUT, (device.label, direction), kib_per_s * 1024.0))
        return out


@register_collector("processes", default=False,
                    help="per-process GPU memory and SM utilization with pid, name, container id")
class GpuProcessCollector(Collector):
    """Per-process memory and SM utilization (opt-in), each from the process's own NVML record.

    Device-level values are never copied onto processes: SM utilization is the mean of NVML's
    per-process samples since the previous round, and 0 for a listed process with none.
    At most ``max_processes`` per device (largest memory first); the rest are counted in
    ``gpuscope_exporter_processes_omitted``::

        gpuscope_gpu_process_memory_bytes{container_id="3f2a…",gpu="0",pid="42",process="python"} 8.6e+09
        gpuscope_gpu_process_sm_utilization_ratio{container_id="3f2a…",gpu="0",pid="42",process="python"} 0.93
    """

    slow = True
    on_mig = True

    @classmethod
    def build(cls, calls: Calls, config: Any, proc_root: str) -> Collector:
        return cls(calls, config.processes_max, proc_root)

    def __init__(self, calls: Calls, max_processes: int, proc_root: str = "/proc") -> None:
        super().__init__(calls)
        self.max_processes = max_processes
        self.proc_root = proc_root
        self._last_seen: dict[str, int] = {}
        self._names: dict[str, ProcessNames] = {}  # per device: each is touched by one lane only

    def applies(self, device: Device) -> bool:
        return True

    def sample(self, device: Device) -> list[Sample]:
        c = self.calls
        procs = c.call(device, "nvmlDeviceGetComputeRunningProcesses") or []
        # NVML answers NOT_FOUND when no sample is newer than the timestamp, and pynvml raises
        # NVMLError(SUCCESS) when there are none at all: both mean "idle", not failure.
        util = c.call(device, "nvmlDeviceGetProcessUtilization", self._last_seen.get(device.label, 0),
                      empty_on=(NOT_FOUND, pynvml.NVML_SUCCESS), empty=[])
        memory: dict[int, float] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            memory[int(p.pid)] = float(used) if used is not None else 0.0
        sm: dict[int, list[float]] = {}
        if util:
            self._last_seen[device.label] = max(int(s.timeStamp) for s in util)
            for s in util:
                sm.setdefault(int(s.pid), []).append(s.smUtil / 100.0)
        pids = sorted(set(memory) | set(sm), key=lambda pid: (-memory.get(pid, 0.0), pid))
        kept = pids[: self.max_processes]
        names = self._names.setdefault(device.label, ProcessNames(self.proc_root))
        out = [Sample(cat.EXPORTER_PROCESSES_OMITTED, (device.label,), float(len(pids) - len(kept)))]
        for pid in kept:
            comm, container = names.lookup(pid)
            labels = (device.label, str(pid), comm, container)
            if pid in memory:
                out.append(Sample(cat.GPU_PROCESS_MEMORY, labels, memory[pid]))
            if util is not None:
                values = sm.get(pid, [0.0])
                out.append(Sample(cat.GPU_PROCESS_SM_UTILIZATION, labels, sum(values) / len(values)))
        names.forget_except(set(kept))
        return out


#: Labels pod attribution (``nvml/podresources.py``) appends to every ``gpuscope_gpu_*`` series.
POD_LABELS = ("namespace", "pod", "container")
_NO_POD = ("", "", "")


@functools.cache
def pod_labelled(metric: cat.Metric) -> cat.Metric:
    """``metric`` with ``POD_LABELS`` after its own labels."""
    return dataclasses.replace(metric, labels=(*metric.labels, *POD_LABELS))


class PodLabelled(Collector):
    """Another collector whose ``gpuscope_gpu_*`` samples (per GPU and per process) get the
    namespace, pod and container the GPU is allocated to; empty when it is allocated to no single
    container. The exporter wraps every collector in it when pod attribution is on, so each family
    has the same label names on every series."""

    def __init__(self, inner: Collector, owner: Callable[[Device], tuple[str, str, str] | None]) -> None:
        super().__init__(inner.calls)
        self.inner = inner
        self.owner = owner
        self.name, self.slow, self.on_mig = inner.name, inner.slow, inner.on_mig

    def applies(self, device: Device) -> bool:
        return self.inner.applies(device)

    def sample(self, device: Device) -> list[Sample]:
        pod = self.owner(device) or _NO_POD
        return [Sample(pod_labelled(s.metric), (*s.labels, *pod), s.value)
                if s.metric.name.startswith("gpuscope_gpu_") else s
                for s in self.inner.sample(device)]
