"""The GPU sources as deployed (dcgm-exporter; the bundle's exporter with pod attribution), as promtool
unit tests for both alert profiles.

``python -m tests.alerts.deployed_gpu_cases`` rewrites ``tests/alerts/cases/sources/gpu-deployed.test.yml``
(production) and ``tests/alerts/cases/sources/test-profile/gpu-deployed.test.yml`` (time compressed 15×:
scrape interval and evaluation times; values unchanged); ``tests/alerts/test_deployed_gpu_cases.py`` fails
when either is stale and runs both with promtool. Series are written as dcgm-exporter writes them
(NVIDIA/dcgm-exporter ``internal/pkg/collector/gpu_collector.go`` and
``internal/pkg/transformation/kubernetes.go``, 3.3 / 4.x: label order, MIG labels, ``err_code`` /
``err_msg`` since 3.3.6, the XID value the code) and as a ServiceMonitor of kube-prometheus-stack
scrapes them (target labels of the exporter's pod; ``exported_*`` under ``honorLabels: false``).

Each case is silent where it must be and fires where it must, and promtool fails on any rule
evaluation error, so every case also proves its joins hold:

- ``mig``: GPU 0 split in two ``3g.40gb`` instances (honorLabels true, a workload each); instance 1
  fills up fast and pages as ``gpu="0/gi1"``; instance 2 and the whole GPU 1 stay silent;
- ``pod replaced``: honorLabels false; GPU 0's workload pod is replaced while its framebuffer fills:
  the page still comes in time (the old pod's series in the range windows used to make the join
  error for 15 minutes); the GPU count per target holds through the replacement and falls when a GPU
  leaves enumeration;
- ``xid per code``: 3.3.6+ per-code series in Kubernetes mode: XID 79 appears as a new ``err_code``
  series and pages with the operator's labels (uuid, name, pod, namespace, container); XID 94 from a
  series whose value is 1 rather than the code pages too (the code read from ``err_code``); an
  application XID (13), an XID from before the rules ran, and the same XID carried into a replacement
  pod's series stay silent;
- ``xid gauge``: before 3.3.6, the last-code gauge: a change to 48 pages, for the XID window only;
- ``own exporter pod replaced``: the bundle's exporter with pod attribution
  (``gpuscope.nvml.collectors.PodLabelled``: the workload's labels on every ``gpuscope_gpu_*``
  sample): a leak carries on through a pod replacement and pages with the new pod's labels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpuscope.alerting import generate
from gpuscope.alerting.rules import duration
from gpuscope.contract.profiles import PRODUCTION, TEST, TEST_COMPRESSION, Profile
from tests.alerts import case_files

ROOT = Path(__file__).resolve().parents[2]
PATHS = {"production": "tests/alerts/cases/sources/gpu-deployed.test.yml",
         "test": "tests/alerts/cases/sources/test-profile/gpu-deployed.test.yml"}
RULES = {"production": "../../../..", "test": "../../../../.."}
JOB = "dcgm-exporter"
#: Both GPU sources' layers, as a fleet running both loads them.
SOURCES = (JOB, "gpuscope-exporter")
MODEL = "NVIDIA H100 80GB HBM3"
RUNBOOK = "https://github.com/gpuscope/gpuscope/blob/main/docs/runbooks.md"
FLEET = "http://localhost:3000/d/gpuscope-fleet"
OPERATOR = {"namespace": "gpu-operator", "service": "nvidia-dcgm-exporter", "endpoint": "gpu-metrics",
            "container": "nvidia-dcgm-exporter"}

Values = Callable[[int], float | None]  # production minute → value (None: no sample)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    mig: tuple[str, str] | None = None

    def labels(self, node: str) -> dict[str, str]:
        bus = f"00000000:{0x18 + 0x12 * self.index:02X}:00.0"
        out = {"gpu": str(self.index), "UUID": self.uuid, "pci_bus_id": bus,
               "device": f"nvidia{self.index}", "modelName": MODEL}
        if self.mig:
            out |= {"GPU_I_PROFILE": self.mig[0], "GPU_I_ID": self.mig[1]}
        return out | {"Hostname": node, "DCGM_FI_DRIVER_VERSION": "550.54.15"}


@dataclass(frozen=True)
class Check:
    minute: int
    alertname: str
    #: Expected alerts: (labels, annotations as a function of the profile).
    firing: tuple[tuple[dict[str, str], Callable[[Profile], dict[str, str]]], ...] = ()


@dataclass
class Case:
    name: str
    minutes: int
    series: list[tuple[str, dict[str, str], Values]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    #: promql checks: (minute, expression, expected label sets with values).
    exprs: list[tuple[int, str, list[dict[str, str]]]] = field(default_factory=list)


def _scrape(instance: str, honor: bool, workload: dict[str, str] | None, exporter_pod: str) -> dict[str, str]:
    """Labels a ServiceMonitor scrape adds: the exporter pod's, the workload's as exported_* when
    ``honorLabels`` is false, the workload's winning when true."""
    target = {"job": JOB, "instance": instance, **OPERATOR, "pod": exporter_pod}
    if not workload:
        return target
    if honor:
        return target | workload
    return target | {f"exported_{k}": v for k, v in workload.items()}


def _pod(name: str, container: str = "vllm") -> dict[str, str]:
    return {"pod": name, "namespace": "inference", "container": container}


def _flat(value: float) -> Values:
    return lambda t: value


def _gpu_series(case: Case, node: str, gpu: Gpu, scrape: dict[str, str], used: Values, total: float,
                alive: Callable[[int], bool] = lambda t: True) -> None:
    labels = {**scrape, **gpu.labels(node)}

    def only(fn: Values) -> Values:
        return lambda t: fn(t) if alive(t) else None

    case.series += [("DCGM_FI_DEV_FB_USED", labels, only(used)),
                    ("DCGM_FI_DEV_FB_FREE", labels, only(lambda t: total - used(t)))]


def _operator(uuid: str, workload: dict[str, str]) -> dict[str, str]:
    """The labels a GPU alert carries from ``gpuscope:gpu:info``: the board, its model, whose workload."""
    return {"uuid": uuid, "name": MODEL, **workload}


def _workload(workload: dict[str, str]) -> str:
    """How a GPU alert's description names the workload on the GPU."""
    return f" (workload {workload['namespace']}/{workload['pod']}, container {workload['container']})"


def _fb_annotations(gpu: str, instance: str, of: str, read: dict[str, tuple[str, str, str]],
                    workload: str = "") -> Callable[[Profile], dict[str, str]]:
    """The framebuffer page's annotations; ``read``: profile → (held, growth, time left) as printed
    (the test profile's growth is 15× faster in real time, its horizon 15× shorter)."""
    def at(p: Profile) -> dict[str, str]:
        holds, growth, left = read[p.name]
        return {"summary": f"GPU {gpu} on {instance} runs out of memory within "
                           f"{duration(p.windows.leak_fast_horizon)}",
                "description": f"GPU {gpu} on {instance}{workload} holds {holds} of {of}, above every peak "
                               f"of the {duration(p.windows.leak_fast_history)} before, and grew {growth} "
                               f"over the last {duration(p.windows.leak_fast_step)}; at that rate the memory "
                               f"runs out in {left}.",
                "runbook_url": f"{RUNBOOK}#gpuframebufferrunningout",
                "dashboard_url": f"{FLEET}?var-instance={instance}&var-gpu={gpu}"}
    return at


def mig() -> Case:
    case = Case("mig: a MIG instance that fills up pages as its own gpu", 100)
    node, instance = "gpu-node-2", "10.42.2.23:9400"
    gpu0 = "GPU-a810a1fc-9f46-0e6f-5cef-bf34c2248e12"
    one, two = Gpu(0, gpu0, ("3g.40gb", "1")), Gpu(0, gpu0, ("3g.40gb", "2"))
    whole = Gpu(1, "GPU-604c7a18-e7d0-02e0-723a-7578be840651")
    pod = "nvidia-dcgm-exporter-q9w4m"
    # Instance 1: 20000 MiB until minute 40, then +500 MiB a minute (out of its 40192 MiB at ~80m).
    _gpu_series(case, node, one, _scrape(instance, True, _pod("embed-6d8f9c7b5-2mzqf", "embed"), pod),
                lambda t: 20000 + 500 * max(0, t - 40), 40192)
    _gpu_series(case, node, two, _scrape(instance, True, _pod("rerank-5c7d8b6f4-h7t2v", "rerank"), pod),
                _flat(12000), 40192)
    _gpu_series(case, node, whole, _scrape(instance, True, _pod("vllm-59b7f4c6d9-w8p3n"), pod), _flat(60000),
                81559)
    case.series.append(("up", {"job": JOB, "instance": instance, **OPERATOR, "pod": pod},
                        _flat(1)))
    embed = _pod("embed-6d8f9c7b5-2mzqf", "embed")
    labels = {"severity": "critical", "service": "gpuscope-exporter", "job": JOB, "instance": instance,
              "gpu": "0/gi1", "trigger": "sustained", **_operator(gpu0, embed)}
    case.checks += [
        Check(45, "GPUFramebufferRunningOut"),
        Check(72, "GPUFramebufferRunningOut", ((labels, _fb_annotations(
            "0/gi1", instance, "39.25GiB",
            {"production": ("35.16GiB", "8.333MiB/s", "8m 23s"),
             "test": ("34.67GiB", "100MiB/s", "46.92s")}, _workload(embed))),)),
        Check(72, "GPUExporterGPUsMissing"),
    ]
    gpus = "gpuscope:exporter_gpus:count{job=\"dcgm-exporter\"}"
    case.exprs.append((72, gpus, [{"job": JOB, "instance": instance, "service": "nvidia-dcgm-exporter",
                                   "endpoint": "gpu-metrics", "value": "3"}]))
    info = 'gpuscope:gpu:info{job="dcgm-exporter",gpu=~"0/.*"}'
    common = {"job": JOB, "instance": instance, "service": "nvidia-dcgm-exporter", "endpoint": "gpu-metrics",
              "uuid": gpu0, "name": MODEL, "mig_parent": "0", "mig_profile": "3g.40gb",
              "namespace": "inference",
              "value": "1"}
    case.exprs.append((72, info, [
        {**common, "gpu": "0/gi1", "pod": "embed-6d8f9c7b5-2mzqf", "container": "embed"},
        {**common, "gpu": "0/gi2", "pod": "rerank-5c7d8b6f4-h7t2v", "container": "rerank"}]))
    return case


def pod_replaced() -> Case:
    case = Case("pod replaced: a leak carries on through a pod replacement; GPUs counted per target", 130)
    node, instance, exporter = "gpu-node-1", "10.42.1.17:9400", "nvidia-dcgm-exporter-7xk2p"
    gpu0, gpu1 = (Gpu(0, "GPU-5fd4f087-86f3-7a43-b711-4771313afc50"),
                  Gpu(1, "GPU-0c4b9a8e-13d4-2b7f-9e0c-8a1d3f7e62b1"))
    old, new = _pod("vllm-7c9f6d5b8-kq8zd"), _pod("vllm-7c9f6d5b8-x2x4q")

    def leak(t: int) -> float:
        return 40960 + 256 * t  # 40 GiB + 15 GiB an hour, out of 79.65 GiB at ~160m

    # The workload's pod is replaced at minute 100: its series' labels change under the same GPU.
    _gpu_series(case, node, gpu0, _scrape(instance, False, old, exporter), leak, 81559, lambda t: t < 100)
    _gpu_series(case, node, gpu0, _scrape(instance, False, new, exporter), leak, 81559, lambda t: t >= 100)
    # GPU 1 (no workload) leaves enumeration at minute 122.
    _gpu_series(case, node, gpu1, _scrape(instance, False, None, exporter), _flat(500), 81559,
                lambda t: t < 122)
    case.series.append(("up", {"job": JOB, "instance": instance, **OPERATOR, "pod": exporter}, _flat(1)))
    leak_labels = {"severity": "warning", "service": "gpuscope-exporter", "job": JOB, "instance": instance,
                   "gpu": "0", **_operator(gpu0.uuid, new)}
    gpus_labels = {"severity": "warning", "service": "gpuscope-exporter", "job": JOB, "instance": instance}
    case.checks += [
        Check(90, "GPUFramebufferFillingUp"),
        Check(120, "GPUFramebufferFillingUp",
              ((leak_labels, _slow_annotations(instance, workload=_workload(new))),)),
        Check(120, "GPUExporterGPUsMissing"),
        Check(130, "GPUExporterGPUsMissing", ((gpus_labels, _gpus_annotations(instance)),)),
    ]
    return case


Read = dict[str, tuple[str, str, str]]  # profile → (held, growth, time left) as an annotation prints them


def _slow_annotations(instance: str, capacity: str = "79.65GiB", read: Read | None = None,
                      workload: str = "") -> Callable[[Profile], dict[str, str]]:
    read = read or {"production": ("70GiB", "4.267MiB/s", "38m 35s"), "test": ("70GiB", "64MiB/s", "2m 34s")}

    def at(p: Profile) -> dict[str, str]:
        holds, growth, left = read[p.name]
        w = p.windows
        return {"summary": f"GPU 0 on {instance} fills its memory",
                "description": f"GPU 0 on {instance}{workload} holds {holds} of {capacity}. Its floor "
                               f"(lowest value over {duration(w.leak_floor)}) grew in every "
                               f"{duration(w.leak_step)} of the last {duration(w.leak - w.leak_floor)}, "
                               f"in the last "
                               f"{duration(w.leak - w.leak_floor - w.leak_step)} by at least {growth}; "
                               f"at that rate the memory runs out in {left}.",
                "runbook_url": f"{RUNBOOK}#gpuframebufferfillingup",
                "dashboard_url": f"{FLEET}?var-instance={instance}&var-gpu=0"}
    return at


def _gpus_annotations(instance: str) -> Callable[[Profile], dict[str, str]]:
    def at(p: Profile) -> dict[str, str]:
        return {"summary": f"The exporter on {instance} sees fewer GPUs than it did",
                "description": f"The exporter on {instance} sees 1 GPU(s); it saw 2 within the last "
                               f"{duration(p.windows.gpus_missing)}. NVML initialisation failures since it "
                               f"started: 0. GPUs it no longer sees have no gpu_up, so GPULost cannot fire "
                               f"for them.",
                "runbook_url": f"{RUNBOOK}#gpuexportergpusmissing",
                "dashboard_url": f"{FLEET}?var-instance={instance}"}
    return at


def _xid_annotations(gpu: str, instance: str, xid: str, workload: str) -> Callable[[Profile], dict[str, str]]:
    def at(p: Profile) -> dict[str, str]:
        return {"summary": f"GPU {gpu} on {instance} reported critical XID {xid}",
                "description": f"GPU {gpu} on {instance}{workload} reported XID {xid} in the last "
                               f"{duration(p.windows.xid)}; this code means a hardware, memory or driver "
                               f"fault, not an application bug.",
                "runbook_url": f"{RUNBOOK}#gpuxidcritical",
                "dashboard_url": f"{FLEET}?var-instance={instance}&var-gpu={gpu}"}
    return at


def xid_per_code() -> Case:
    case = Case("xid per code: a new err_code series pages with whose workload it is", 40)
    node, instance, exporter = "gpu-node-2", "10.42.2.23:9400", "nvidia-dcgm-exporter-q9w4m"
    gpus = [Gpu(i, f"GPU-604c7a18-e7d0-02e0-723a-7578be84065{i}") for i in range(4)]
    old, new = _pod("vllm-59b7f4c6d9-w8p3n"), _pod("vllm-59b7f4c6d9-zr6kc")
    messages = {0: "No Error", 13: "Graphics Engine Exception", 48: "DBE (Double Bit Error) ECC Error",
                79: "GPU has fallen off the bus", 94: "Contained ECC error"}

    def xid(gpu: Gpu, workload: dict[str, str], code: int, alive: Callable[[int], bool],
            value: float | None = None) -> None:
        labels = {**_scrape(instance, True, workload, exporter), **gpu.labels(node), "err_code": str(code),
                  "err_msg": messages[code]}
        written = code if value is None else value
        case.series.append(("DCGM_FI_DEV_XID_ERRORS", labels, lambda t: written if alive(t) else None))

    # GPU 0: no error, then XID 79 at minute 10 (a new series: err_code="79", value 79); its pod is
    # replaced at minute 20 and the new pod's series carries the same last XID.
    xid(gpus[0], old, 0, lambda t: t < 10)
    xid(gpus[0], old, 79, lambda t: 10 <= t < 20)
    xid(gpus[0], new, 79, lambda t: t >= 20)
    for workload, alive in ((old, lambda t: t < 20), (new, lambda t: t >= 20)):
        scrape = _scrape(instance, True, workload, exporter)
        _gpu_series(case, node, gpus[0], scrape, _flat(60000), 81559, alive)
    # Traps: GPU 1, an application's XID 13 at minute 10; GPU 2, XID 48 from before the rules ran.
    xid(gpus[1], _pod("batch-7f9c6d5b8-lm2pq"), 0, lambda t: t < 10)
    xid(gpus[1], _pod("batch-7f9c6d5b8-lm2pq"), 13, lambda t: t >= 10)
    xid(gpus[2], _pod("vllm-59b7f4c6d9-b5t9x"), 48, lambda t: True)
    # GPU 3: XID 94 at minute 10 from a build that writes 1 for a new code rather than the code (as the
    # format is sometimes described): the code is read from err_code. No info series: no operator labels.
    xid(gpus[3], {}, 0, lambda t: t < 10)
    xid(gpus[3], {}, 94, lambda t: t >= 10, value=1)
    case.series.append(("up", {"job": JOB, "instance": instance, **OPERATOR, "pod": exporter}, _flat(1)))
    labels = {"severity": "critical", "service": "gpuscope-exporter", "job": JOB, "instance": instance,
              "endpoint": "gpu-metrics", "gpu": "0", "xid": "79", "uuid": gpus[0].uuid, "name": MODEL,
              **old}
    workload = f" (workload inference/{old['pod']}, container vllm)"
    bare = {"severity": "critical", "service": "gpuscope-exporter", "job": JOB, "instance": instance,
            "endpoint": "gpu-metrics", "gpu": "3", "xid": "94"}
    case.checks += [
        Check(9, "GPUXidCritical"),
        Check(12, "GPUXidCritical", ((labels, _xid_annotations("0", instance, "79", workload)),
                                     (bare, _xid_annotations("3", instance, "94", "")))),
        Check(27, "GPUXidCritical"),
    ]
    return case


def xid_gauge() -> Case:
    case = Case("xid gauge: before 3.3.6, a change of the last-code gauge pages", 40)
    node, instance = "gpu-node-3", "gpu-node-3:9400"
    gpu = Gpu(0, "GPU-213c841d-7181-629b-9a20-5c80fbd75ad9")
    scrape = {"job": JOB, "instance": instance}
    case.series.append(("DCGM_FI_DEV_XID_ERRORS", {**scrape, **gpu.labels(node)},
                        lambda t: 0 if t < 10 else 48))
    _gpu_series(case, node, gpu, scrape, _flat(1000), 81559)
    case.series.append(("up", scrape, _flat(1)))
    labels = {"severity": "critical", "service": "gpuscope-exporter", "job": JOB, "instance": instance,
              "gpu": "0", "xid": "48", "uuid": gpu.uuid, "name": MODEL}
    case.checks += [
        Check(9, "GPUXidCritical"),
        Check(12, "GPUXidCritical", ((labels, _xid_annotations("0", instance, "48", "")),)),
        Check(30, "GPUXidCritical"),
    ]
    return case


def own_exporter_pod_replaced() -> Case:
    case = Case("own exporter pod replaced: a leak carries on through a pod replacement", 130)
    instance, scrape = "gpu-node-4:9835", {"job": "gpuscope-exporter", "instance": "gpu-node-4:9835"}
    gib = 1 << 30
    old, new = _pod("vllm-0-6b8d9f7c4-pq2ls"), _pod("vllm-0-6b8d9f7c4-t7xvn")
    for workload, alive in ((old, lambda t: t < 100), (new, lambda t: t >= 100)):
        labels = {**scrape, "gpu": "0", **workload}
        case.series += [
            ("gpuscope_gpu_memory_used_bytes", labels,
             lambda t, a=alive: (40 * gib + 15 * gib * t / 60) if a(t) else None),
            ("gpuscope_gpu_memory_total_bytes", labels, lambda t, a=alive: 80 * gib if a(t) else None)]
    case.series += [("gpuscope_gpu_info", {**scrape, "gpu": "0", "uuid": "GPU-1", "name": MODEL}, _flat(1)),
                    ("up", scrape, _flat(1))]
    labels = {"severity": "warning", "service": "gpuscope-exporter", **scrape, "gpu": "0",
              **_operator("GPU-1", new)}
    case.checks += [
        Check(90, "GPUFramebufferFillingUp"),
        Check(120, "GPUFramebufferFillingUp", ((labels, _own_annotations(instance, _workload(new))),)),
    ]
    return case


def _own_annotations(instance: str, workload: str) -> Callable[[Profile], dict[str, str]]:
    return _slow_annotations(instance, "80GiB", {"production": ("70GiB", "4.267MiB/s", "40m 0s"),
                                                 "test": ("70GiB", "64MiB/s", "2m 40s")}, workload)


CASES = (mig, pod_replaced, xid_per_code, xid_gauge, own_exporter_pod_replaced)


def _values(fn: Values, minutes: int) -> str:
    """One value a minute; where a series stops, a staleness marker, as a scrape writes one when the
    series is gone from the exposition (else it would linger 5 minutes in every instant query)."""
    out, before = [], None
    for t in range(minutes + 1):
        v = fn(t)
        out.append(("stale" if before is not None else "_") if v is None else f"{v:g}")
        before = v
    return " ".join(out)


def _seconds(minute: int, p: Profile) -> str:
    return f"{minute * 60 // (TEST_COMPRESSION if p is TEST else 1)}s"


def _series_text(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def render(p: Profile) -> str:
    rules = RULES[p.name]
    doc: dict = {
        "rule_files": [f"{rules}/{path}" for path in
                       (*(generate.source_rules_path(p, s) for s in SOURCES),
                        generate.prometheus_rules_path(p))],
        "group_eval_order": generate.group_order(p, SOURCES),
        "evaluation_interval": f"{p.evaluation_interval}s",
        "tests": [],
    }
    for make in CASES:
        case = make()
        test: dict = {"name": case.name, "interval": f"{60 // (TEST_COMPRESSION if p is TEST else 1)}s",
                      "input_series": [{"series": _series_text(name, labels),
                                        "values": _values(fn, case.minutes)}
                                       for name, labels, fn in case.series]}
        test["alert_rule_test"] = [
            {"eval_time": _seconds(c.minute, p), "alertname": c.alertname,
             "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations(p)}
                            for labels, annotations in c.firing]}
            for c in case.checks]
        if case.exprs:
            test["promql_expr_test"] = [
                {"eval_time": _seconds(minute, p), "expr": expr,
                 "exp_samples": [{"labels": _series_text(expr.split("{")[0],
                                                         {k: v for k, v in s.items() if k != "value"}),
                                  "value": float(s["value"])} for s in samples]}
                for minute, expr, samples in case.exprs]
        doc["tests"].append(test)
    header = (f"# Generated by `python -m tests.alerts.deployed_gpu_cases` ({p.name} profile); do not edit.\n"
              "# What each case is and why: tests/alerts/deployed_gpu_cases.py.\n")
    return header + yaml.safe_dump(doc, sort_keys=False, width=200)


def outputs() -> dict[str, str]:
    return {PATHS[p.name]: render(p) for p in (PRODUCTION, TEST)}


def main() -> int:
    return case_files.write(outputs())


if __name__ == "__main__":
    raise SystemExit(main())
