"""What the rendered workloads promise: GPU scheduling, the PodResources socket, hardening, probes,
the same server flags as compose, an HPA aimed at real objects."""

from __future__ import annotations

import pytest

from gpuscope.contract.profiles import PRODUCTION
from gpuscope.kube.config import DEPLOYMENT
from gpuscope.kube.render import OVERLAYS
from gpuscope.nvml.podresources import DEFAULT_SOCKET
from gpuscope.ops.stack import SERVER_TENANTS
from gpuscope.util.flags import env_name
from tests.kube.conftest import all_rendered, find, rendered

N = DEPLOYMENT.names
WORKLOADS = ("Deployment", "DaemonSet")


def _workloads(overlay: str) -> list[dict]:
    return [o for o in rendered(overlay) if o["kind"] in WORKLOADS]


def _pod(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _container(obj: dict, name: str) -> dict:
    return next(c for c in _pod(obj)["containers"] if c["name"] == name)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"{o}-overlay" for o in OVERLAYS])
def test_every_container_is_hardened_sized_and_probed(overlay: str) -> None:
    for obj in _workloads(overlay):
        pod = _pod(obj)
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            where = f"{overlay} {obj['metadata']['name']}/{c['name']}"
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), where
            assert {"cpu", "memory"} <= c["resources"]["limits"].keys(), where
            assert "readinessProbe" in c and "livenessProbe" in c, where
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), where  # HOME=/tmp in the image


def test_only_the_gpu_exporter_runs_as_root_and_only_for_the_socket() -> None:
    for overlay, obj in all_rendered():
        if obj["kind"] not in WORKLOADS:
            continue
        sc = _pod(obj)["securityContext"]
        if overlay == "gpu" and obj["metadata"]["name"] == N.exporter:
            assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False
        else:
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, f"{overlay} {obj['metadata']['name']}"


def test_exporter_on_gpu_nodes_reads_the_pod_resources_socket() -> None:
    ds = find("gpu", "DaemonSet", N.exporter)
    pod, c = _pod(ds), _container(ds, "exporter")
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env[env_name("--kubernetes.pod-resources-socket")] == DEFAULT_SOCKET
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    socket_dir = DEFAULT_SOCKET.rsplit("/", 1)[0]
    volume = next(v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == socket_dir)
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": socket_dir, "readOnly": True}
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})  # watches every GPU, claims none
    # health endpoints on the metrics port
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # The CPU demo runs it without GPUs, the socket or root.
    plain = find("cpu-demo", "DaemonSet", N.exporter)
    assert "runtimeClassName" not in _pod(plain) and "env" not in _container(plain, "exporter")


def test_server_gets_one_gpu_in_the_gpu_overlay_only() -> None:
    gpu = find("gpu", "Deployment", N.server)
    assert _container(gpu, "server")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _pod(gpu)["runtimeClassName"] == "nvidia"
    assert _pod(gpu)["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    cpu = find("cpu-demo", "Deployment", N.server)
    assert "nvidia.com/gpu" not in _container(cpu, "server")["resources"]["limits"]
    assert "runtimeClassName" not in _pod(cpu)


def test_server_serves_the_tenants_compose_and_the_stack_serve() -> None:
    args = _container(find("gpu", "Deployment", N.server), "server")["args"]
    assert args[0] == "serve"
    assert f"--tenants={SERVER_TENANTS}" in args


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"{o}-overlay" for o in OVERLAYS])
def test_services_and_monitors_point_at_real_ports(overlay: str) -> None:
    services = {o["metadata"]["name"]: o for o in rendered(overlay) if o["kind"] == "Service"}
    workloads = {o["metadata"]["name"]: o for o in _workloads(overlay)}
    for name, svc in services.items():
        pod_labels = workloads[name]["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        ports = {p["name"] for c in _pod(workloads[name])["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    for monitor in (o for o in rendered(overlay) if o["kind"] == "ServiceMonitor"):
        svc = services[monitor["metadata"]["name"]]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert monitor["metadata"]["namespace"] == svc["metadata"]["namespace"]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
        assert monitor["metadata"]["labels"]["release"] == DEPLOYMENT.cluster.release


def test_hpa_scales_the_server_on_ttft_and_gpu_busy() -> None:
    a = DEPLOYMENT.autoscaling
    hpa = find("gpu", "HorizontalPodAutoscaler", N.hpa)
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": N.server}
    find("gpu", "Deployment", N.server)
    ttft, gpu = spec["metrics"]
    assert ttft["object"]["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": N.server}
    find("gpu", "Service", N.server)
    assert ttft["object"]["metric"]["name"] == a.ttft_metric
    assert float(ttft["object"]["target"]["value"]) == PRODUCTION.thresholds.slo_ttft_objective_s
    assert gpu["pods"]["metric"]["name"] == a.gpu_busy_metric
    assert gpu["pods"]["target"]["averageValue"] == f"{round(a.gpu_busy_target * 1000)}m"
    behavior = spec["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert down["stabilizationWindowSeconds"] > up["stabilizationWindowSeconds"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300  # longer than the default 5 minutes
    assert 1 <= spec["minReplicas"] < spec["maxReplicas"]
    # The server's Deployment leaves the replica count to the HPA's minimum.
    assert find("gpu", "Deployment", N.server)["spec"]["replicas"] == spec["minReplicas"]
    cpu = find("cpu-demo", "HorizontalPodAutoscaler", N.hpa)
    assert [m["type"] for m in cpu["spec"]["metrics"]] == ["Object"]
