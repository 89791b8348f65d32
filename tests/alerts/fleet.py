"""A realistic fleet's series, as Prometheus stores them, written as OpenMetrics for a TSDB backfill.

What each part follows (the labels and values its upstream writes):

- dcgm-exporter: NVIDIA/dcgm-exporter ``etc/default-counters.csv`` (3.3 / 4.x) and its GPU collector
  (``internal/pkg/collector/gpu_collector.go``, 3.3.6+: ``DCGM_FI_DEV_XID_ERRORS`` carries
  ``err_code`` and ``err_msg``, its value still the code, so each code is its own series; before, a bare
  last-code gauge). MIG instances carry ``GPU_I_PROFILE`` and ``GPU_I_ID`` with their parent's ``gpu``
  (the collector's ``MigProfile`` / ``GPUInstanceID``). The Kubernetes mapper
  (``internal/pkg/transformation/kubernetes.go``) adds the workload's ``pod``, ``namespace`` and
  ``container``.
- The scrape, as kube-prometheus-stack's ServiceMonitor of the dcgm-exporter Helm chart
  (``deployment/templates/service-monitor.yaml``) writes it: target labels ``namespace``, ``service``,
  ``pod``, ``container``, ``endpoint`` of the *exporter's* pod. With ``honorLabels: false`` (the chart's
  default) the workload's labels become ``exported_pod`` / ``exported_namespace`` /
  ``exported_container``; with ``honorLabels: true`` they win, and GPUs without a workload carry none.
- vLLM: ``vllm/v1/metrics/loggers.py`` (v0.12), two data-parallel engines (``engine="0"``, ``"1"``) of
  one served model, every family of ``gpuscope.contract.upstream``.
- The bundle's own server and exporter: every catalogue metric of their areas, with its labels; the
  exporter with pod attribution on, GPU 0's workload pod replaced 10 minutes ago.

The fleet (times relative to the end of the history, ``now``):

- ``gpu-node-1`` (ServiceMonitor, honorLabels false, dcgm-exporter 4.x): GPU 0 serves a vLLM pod that
  was replaced 10 minutes ago (the old pod's series stop then, and stay inside range windows); GPU 1
  has no workload.
- ``gpu-node-2`` (ServiceMonitor, honorLabels true, dcgm-exporter 4.x, MIG): GPU 0 split in two
  ``3g.40gb`` instances, one workload each; GPU 1 whole, its pod replaced 10 minutes ago; XID 79 on
  GPU 1 five minutes ago (a new ``err_code`` series).
- ``gpu-node-3`` (bare metal, static scrape, dcgm-exporter 3.3.5): XID 48 on GPU 0 five minutes ago
  (the last-code gauge changes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuscope.contract import catalogue as m
from gpuscope.contract import upstream as up

DRIVER = "550.54.15"
MODEL = "NVIDIA H100 80GB HBM3"
#: The dcgm-exporter job as the chart's ServiceMonitor names it (its Service) and as the bundle selects it.
DCGM_JOB = "dcgm-exporter"
CHURN_S = 600       # the pod replacement, seconds before now
XID_AT_S = 300      # the XIDs, seconds before now
XID_MESSAGES = {0: "No Error", 48: "DBE (Double Bit Error) ECC Error", 79: "GPU has fallen off the bus"}


@dataclass(frozen=True)
class Series:
    """One series: its name, labels, and its value as a function of seconds before now (None: absent)."""

    name: str
    labels: dict[str, str]
    value: object  # Callable[[float], float | None]

    def text(self, ago: float, at: float) -> str | None:
        v = self.value(ago)  # type: ignore[operator]
        if v is None:
            return None
        body = ",".join(f'{k}="{val}"' for k, val in self.labels.items() if val != "")
        return f"{self.name}{{{body}}} {v:.6g} {at:.3f}"


@dataclass
class Gpu:
    node: str
    index: int
    uuid: str
    bus: str
    mig: tuple[str, str] | None = None            # (GPU_I_PROFILE, GPU_I_ID)
    #: (workload labels, alive while seconds-before-now is in [until, since)), newest last.
    pods: list[tuple[dict[str, str], float, float]] = field(default_factory=list)
    xid: int = 0                                    # the XID that arrives XID_AT_S before now
    used_mib: float = 20000.0
    total_mib: float = 81559.0                      # an H100 80GB's framebuffer; a 3g.40gb instance's less


@dataclass(frozen=True)
class Target:
    """One dcgm-exporter scrape target: its target labels and how workload labels land."""

    instance: str
    node: str
    target_labels: dict[str, str]
    honor_labels: bool
    per_code_xid: bool


def _always(value: float):
    return lambda ago: value


def _between(value, since: float, until: float):
    """``value`` while ``until <= ago < since`` (seconds before now), absent otherwise."""
    return lambda ago: value(ago) if until <= ago < since else None


def _workload_labels(target: Target, pod: dict[str, str]) -> dict[str, str]:
    if not pod:
        return {}
    if target.honor_labels:
        return dict(pod)
    return {f"exported_{k}": v for k, v in pod.items()}


def _dcgm_labels(target: Target, gpu: Gpu) -> dict[str, str]:
    """The labels dcgm-exporter writes, in its order (MIG between modelName and Hostname)."""
    labels = {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.bus, "device": f"nvidia{gpu.index}",
              "modelName": MODEL}
    if gpu.mig:
        labels |= {"GPU_I_PROFILE": gpu.mig[0], "GPU_I_ID": gpu.mig[1]}
    return labels | {"Hostname": gpu.node, "DCGM_FI_DRIVER_VERSION": DRIVER}


def _dcgm_series(target: Target, gpu: Gpu, scrape: dict[str, str]) -> Iterator[Series]:
    base = _dcgm_labels(target, gpu)
    pods = gpu.pods or [({}, math.inf, -math.inf)]
    for pod, since, until in pods:
        # honorLabels false: the target's labels win and the workload's are kept as exported_*;
        # true: the workload's win over the target's.
        labels = {**scrape, **target.target_labels, **base, **_workload_labels(target, pod)}

        def at(value, since=since, until=until):
            return _between(value, since, until)

        # Framebuffer: a slow, allocate/free wave that never nears capacity.
        used = (lambda u: lambda ago: u + 500 * math.sin(ago / 300))(gpu.used_mib)
        yield Series("DCGM_FI_DEV_FB_USED", labels, at(used))
        yield Series("DCGM_FI_DEV_FB_FREE", labels, at(lambda ago, u=used, t=gpu.total_mib: t - u(ago)))
        yield Series("DCGM_FI_PROF_GR_ENGINE_ACTIVE", labels, at(_always(0.61)))
        yield Series("DCGM_FI_DEV_MEM_COPY_UTIL", labels, at(_always(34)))
        yield Series("DCGM_FI_DEV_GPU_TEMP", labels, at(_always(58)))
        yield Series("DCGM_FI_DEV_MEMORY_TEMP", labels, at(_always(61)))
        yield Series("DCGM_FI_DEV_POWER_USAGE", labels, at(_always(455.2)))
        yield Series("DCGM_FI_DEV_POWER_MGMT_LIMIT", labels, at(_always(700)))
        yield Series("DCGM_FI_DEV_SM_CLOCK", labels, at(_always(1980)))
        yield Series("DCGM_FI_DEV_MEM_CLOCK", labels, at(_always(2619)))
        yield Series("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", labels,
                     at(lambda ago: 9e10 - 455_200 * ago))
        yield Series("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", labels, at(_always(0)))
        yield Series("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", labels, at(_always(1)))
        yield from _xid(target, gpu, labels, at)


def _xid(target: Target, gpu: Gpu, labels: dict[str, str], at) -> Iterator[Series]:
    def code(ago: float) -> int:
        return gpu.xid if ago < XID_AT_S else 0

    if not target.per_code_xid:
        yield Series("DCGM_FI_DEV_XID_ERRORS", labels, at(lambda ago: code(ago)))
        return
    for c in sorted({0, gpu.xid}):
        coded = {**labels, "err_code": str(c), "err_msg": XID_MESSAGES[c]}
        # Each code its own series, present while it is the last XID; its value is the code.
        yield Series("DCGM_FI_DEV_XID_ERRORS", coded,
                     at(lambda ago, c=c: float(c) if code(ago) == c else None))


def _dcgm_fleet() -> Iterator[Series]:
    operator = {"namespace": "gpu-operator", "service": "nvidia-dcgm-exporter", "endpoint": "gpu-metrics",
                "container": "nvidia-dcgm-exporter"}
    node1 = Target("10.42.1.17:9400", "gpu-node-1", {**operator, "pod": "nvidia-dcgm-exporter-7xk2p"},
                   honor_labels=False, per_code_xid=True)
    node2 = Target("10.42.2.23:9400", "gpu-node-2", {**operator, "pod": "nvidia-dcgm-exporter-q9w4m"},
                   honor_labels=True, per_code_xid=True)
    node3 = Target("gpu-node-3:9400", "gpu-node-3", {}, honor_labels=False, per_code_xid=False)

    def vllm(pod: str) -> dict[str, str]:
        return {"pod": pod, "namespace": "inference", "container": "vllm"}

    churn = [(vllm("vllm-7c9f6d5b8-kq8zd"), math.inf, CHURN_S),
             (vllm("vllm-7c9f6d5b8-x2x4q"), CHURN_S, -math.inf)]
    gpus = [
        (node1, [Gpu("gpu-node-1", 0, "GPU-5fd4f087-86f3-7a43-b711-4771313afc50", "00000000:18:00.0",
                    pods=list(churn), used_mib=70000),
                Gpu("gpu-node-1", 1, "GPU-0c4b9a8e-13d4-2b7f-9e0c-8a1d3f7e62b1", "00000000:2A:00.0")]),
        (node2, [Gpu("gpu-node-2", 0, "GPU-a810a1fc-9f46-0e6f-5cef-bf34c2248e12", "00000000:18:00.0",
                    mig=("3g.40gb", "1"), pods=[(vllm("embed-6d8f9c7b5-2mzqf"), math.inf, -math.inf)],
                    used_mib=30000, total_mib=40192),
                Gpu("gpu-node-2", 0, "GPU-a810a1fc-9f46-0e6f-5cef-bf34c2248e12", "00000000:18:00.0",
                    mig=("3g.40gb", "2"), pods=[(vllm("rerank-5c7d8b6f4-h7t2v"), math.inf, -math.inf)],
                    used_mib=12000, total_mib=40192),
                Gpu("gpu-node-2", 1, "GPU-604c7a18-e7d0-02e0-723a-7578be840651", "00000000:2A:00.0",
                    pods=[(vllm("vllm-59b7f4c6d9-w8p3n"), math.inf, CHURN_S),
                          (vllm("vllm-59b7f4c6d9-zr6kc"), CHURN_S, -math.inf)], xid=79, used_mib=72000)]),
        (node3, [Gpu("gpu-node-3", 0, "GPU-213c841d-7181-629b-9a20-5c80fbd75ad9", "00000000:3B:00.0", xid=48),
                Gpu("gpu-node-3", 1, "GPU-8345bdf0-6a9c-e1c1-5994-9e656aed3abc", "00000000:5C:00.0")]),
    ]
    for target, devices in gpus:
        scrape = {"job": DCGM_JOB, "instance": target.instance}
        yield Series("up", {**scrape, **target.target_labels}, _always(1))
        for gpu in devices:
            yield from _dcgm_series(target, gpu, scrape)


def _label_value(label: str, i: int) -> str:
    values = {"gpu": ("0", "1"), "device": ("cuda:0", "cuda:1"), "op": ("decode", "prefill"),
              "tenant": ("chat", "batch"), "reason": ("sw_power_cap", "hw_thermal_slowdown"),
              "outcome": ("ok", "error"), "call": ("nvmlInit", "nvmlDeviceGetPowerUsage"),
              "collector": ("fast", "slow"), "type": ("volatile_corrected", "volatile_uncorrected"),
              "uuid": ("GPU-1", "GPU-2"), "name": ("NVIDIA H100 80GB HBM3",) * 2}
    return values.get(label, ("a", "b"))[i % 2]


def _catalogue_series(metric: m.Metric, scrape: dict[str, str], rate: float) -> Iterator[Series]:
    """Every label combination of two values each (at most 4), counters growing at ``rate``."""
    combos = [{label: _label_value(label, i) for label in metric.labels}
              for i in range(2 if metric.labels else 1)]
    for labels in combos:
        labels = {**scrape, **labels}
        if metric.type == "counter":
            yield Series(metric.name, labels, lambda ago: 1e6 - rate * ago)
        elif metric.type == "histogram":
            yield from _histogram(metric.name, labels, metric.buckets or (0.1, 1.0), rate)
        elif metric.type == "info":
            yield Series(metric.name, labels, _always(1))
        else:
            yield Series(metric.name, labels, _always(0.4))


def _histogram(name: str, labels: dict[str, str], buckets: tuple[float, ...],
               rate: float) -> Iterator[Series]:
    def count(ago: float) -> float:
        return 1e6 - rate * ago

    for i, le in enumerate((*buckets, math.inf)):
        share = 1.0 if le == math.inf else (i + 1) / (len(buckets) + 1)
        yield Series(f"{name}_bucket", {**labels, "le": "+Inf" if le == math.inf else f"{le:g}"},
                     lambda ago, s=share: count(ago) * s)
    yield Series(f"{name}_count", labels, count)
    yield Series(f"{name}_sum", labels, lambda ago: count(ago) * 0.05)


def _pod_attributed(series: Series) -> Iterator[Series]:
    """The bundle's exporter with pod attribution (``gpuscope.nvml.collectors.PodLabelled``): per-GPU
    ``gpuscope_gpu_*`` samples of GPU 0 carry its workload's pod, replaced ``CHURN_S`` before now."""
    if not series.name.startswith("gpuscope_gpu_") or series.labels.get("gpu") != "0" \
            or series.name == m.GPU_INFO.name:
        yield series
        return
    for pod, alive in (("vllm-0-6b8d9f7c4-pq2ls", lambda ago: ago >= CHURN_S),
                       ("vllm-0-6b8d9f7c4-t7xvn", lambda ago: ago < CHURN_S)):
        labels = {**series.labels, "namespace": "inference", "pod": pod, "container": "vllm"}
        yield Series(series.name, labels, lambda ago, v=series.value, a=alive: v(ago) if a(ago) else None)


def _bundle() -> Iterator[Series]:
    server = {"job": "gpuscope-server", "instance": "inference-1:8000"}
    exporter = {"job": "gpuscope-exporter", "instance": "gpu-node-4:9835"}
    yield Series("up", server, _always(1))
    yield Series("up", exporter, _always(1))
    for metric in m.all_metrics():
        if metric.area in (m.TIMING, m.SERVER, m.LOGS):
            yield from _catalogue_series(metric, server, 20.0)
        elif metric.area == m.GPU:
            for series in _catalogue_series(metric, exporter, 0.0):
                yield from _pod_attributed(series)


def _vllm() -> Iterator[Series]:
    for engine in ("0", "1"):
        scrape = {"job": "vllm", "instance": "vllm-0:8000"}
        for metric in up.VLLM_METRICS:
            labels = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": engine}
            if "finished_reason" in metric.labels:
                for reason in up.VLLM_FINISH_REASONS:
                    yield Series(metric.name, {**scrape, **labels, "finished_reason": reason},
                                 lambda ago: 1e5 - 5 * ago)
            elif metric.type == "histogram":
                yield from _histogram(metric.name, {**scrape, **labels}, metric.buckets or (), 10.0)
            elif metric.type == "counter":
                yield Series(metric.name, {**scrape, **labels}, lambda ago: 1e6 - 300 * ago)
            else:
                yield Series(metric.name, {**scrape, **labels}, _always(0.5))
    yield Series("up", {"job": "vllm", "instance": "vllm-0:8000"}, _always(1))


def series() -> list[Series]:
    return [*_dcgm_fleet(), *_vllm(), *_bundle()]


def openmetrics(now: float, history_s: int, future_s: int, step_s: int) -> Iterator[str]:
    """The fleet from ``now - history_s`` to ``now + future_s`` every ``step_s``, time-major (each
    series in time order, as the backfill's appender needs), ending with ``# EOF``."""
    fleet = series()
    for offset in range(-history_s, future_s + 1, step_s):
        at = now + offset
        for s in fleet:
            line = s.text(float(-offset), at)
            if line is not None:
                yield line + "\n"
    yield "# EOF\n"
