"""Where gpuscope is deployed on Kubernetes, and how its server scales: one place for every name.

The alerting configuration (``gpuscope.contract.profiles``) stays the source of what is alerted on:
job names, the TTFT objective and the latency window come from there. This module holds only what
a cluster adds: namespaces, the kube-prometheus-stack release the Prometheus Operator objects are
labelled for, in-cluster URLs, the autoscaling targets, and the image tags (from pyproject.toml's
version; the build arguments from docker-compose.yml's pinned versions).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpuscope.contract import catalogue as m
from gpuscope.contract import names, parts
from gpuscope.contract.parts import PORTS


@dataclass(frozen=True)
class Cluster:
    """The cluster and the kube-prometheus-stack installation gpuscope joins."""

    #: Namespace of the server, the exporter, the receiver and their monitoring objects.
    namespace: str = "gpuscope"
    #: kube-prometheus-stack's namespace: the Alertmanager config Secret, the Grafana sidecar's
    #: ConfigMaps and prometheus-adapter's rules live there.
    monitoring_namespace: str = "monitoring"
    #: kube-prometheus-stack's Helm release name. Its Prometheus selects ServiceMonitors and
    #: PrometheusRules labelled ``release: <this>`` (the chart's default selectors); its services are
    #: called ``<this>-prometheus`` and ``<this>-alertmanager``.
    release: str = "kube-prometheus-stack"
    #: Scrape interval of gpuscope's ServiceMonitors (also Grafana's ``timeInterval``).
    scrape_interval_s: int = 15

    @property
    def prometheus_url(self) -> str:
        return f"http://{self.release}-prometheus.{self.monitoring_namespace}.svc:{PORTS['prometheus']}"

    @property
    def alertmanager_url(self) -> str:
        return f"http://{self.release}-alertmanager.{self.monitoring_namespace}.svc:{PORTS['alertmanager']}"

    def service_url(self, name: str, port: int, path: str = "") -> str:
        return f"http://{name}.{self.namespace}.svc:{port}{path}"


@dataclass(frozen=True)
class Autoscaling:
    """The server's HorizontalPodAutoscaler: p95 TTFT against the SLO's objective, and GPU busy.

    The HPA takes the larger replica count the two metrics ask for, so either one scales up. The
    TTFT objective and window are the alerting config's (``slo_ttft_objective_s``, ``windows.latency``).
    """

    min_replicas: int = 1
    max_replicas: int = 4
    #: Quantile of TTFT compared with the objective.
    ttft_quantile: float = 0.95
    #: Average over the server's pods of the busiest GPU of each pod (NVML utilization, 0–1).
    gpu_busy_target: float = 0.8
    #: Window GPU utilization is averaged over (NVML's own reading covers only its last sample period).
    gpu_busy_window_s: int = 120
    #: Scale-up: act on the highest recommendation of the last minute, one pod per two minutes at
    #: most (a new server loads its model before it takes traffic; its metrics need a window to show).
    scale_up_stabilization_s: int = 60
    scale_up_pods: int = 1
    scale_up_period_s: int = 120
    #: Scale-down: only when every recommendation of the last ten minutes agrees; one pod per five
    #: minutes. Bursty traffic would otherwise flap a GPU pod (and its minutes of model load).
    scale_down_stabilization_s: int = 600
    scale_down_pods: int = 1
    scale_down_period_s: int = 300

    # Names in the custom metrics API (prometheus-adapter serves them), as the contract has them.
    @property
    def ttft_metric(self) -> str:
        return names.custom_quantile(m.REQUEST_TTFT, self.ttft_quantile)

    @property
    def gpu_busy_metric(self) -> str:
        return names.POD_GPU_BUSY


@dataclass(frozen=True)
class Names:
    """Workload names. Services are named like the alert config's job names (a test checks it)."""

    server: str = parts.SERVER.service
    exporter: str = parts.EXPORTER.service
    receiver: str = parts.RECEIVER.service
    hpa: str = parts.SERVER.service
    prometheus_rule: str = "gpuscope"
    alertmanager_secret: str = "gpuscope-alertmanager"
    adapter_config: str = "gpuscope-prometheus-adapter"
    datasources: str = "gpuscope-grafana-datasources"
    dashboard_prefix: str = "gpuscope-dashboard-"


@dataclass(frozen=True)
class Deployment:
    cluster: Cluster = field(default_factory=Cluster)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    names: Names = field(default_factory=Names)


DEPLOYMENT = Deployment()

#: Image names the manifests use; the generated images components map them to real tags: the
#: server's to the CUDA build in the gpu overlay, everything else to the CPU build (the exporter needs
#: no CUDA: the nvidia runtime mounts NVML from the driver).
IMAGE = "gpuscope"
IMAGE_SERVER = "gpuscope-server-image"


def project_version(root: Path) -> str:
    """``[project] version`` of pyproject.toml (the gpuscope image's tag)."""
    text = (root / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    if not match:
        raise ValueError("pyproject.toml has no [project] version")
    return match.group(1)


@dataclass(frozen=True)
class ImageBuild:
    """How the gpuscope images are built: docker-compose.yml's pinned versions and the GPU override's
    CUDA wheel index, so the Kubernetes tags name images built exactly as compose builds them."""

    version: str
    python_image: str
    torch_version: str
    cpu_index_url: str
    cuda_index_url: str

    @property
    def tag(self) -> str:
        return self.version

    @property
    def cuda_tag(self) -> str:
        return f"{self.version}-cuda"

    def command(self, cuda: bool) -> str:
        tag = self.cuda_tag if cuda else self.tag
        index = self.cuda_index_url if cuda else self.cpu_index_url
        return (f"docker build --build-arg PYTHON_IMAGE={self.python_image} "
                f"--build-arg TORCH_VERSION={self.torch_version} --build-arg TORCH_INDEX_URL={index} "
                f"-t {IMAGE}:{tag} .")


def image_build(root: Path) -> ImageBuild:
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    gpu = yaml.safe_load((root / "docker-compose.gpu.yml").read_text())
    versions = compose["x-versions"]
    return ImageBuild(
        version=project_version(root),
        python_image=versions["python"],
        torch_version=str(versions["torch"]),
        cpu_index_url=compose["x-gpuscope"]["build"]["args"]["TORCH_INDEX_URL"],
        cuda_index_url=gpu["services"]["server"]["build"]["args"]["TORCH_INDEX_URL"],
    )


def job_of(selector: str) -> str:
    """``'job="gpuscope-server"'`` → ``gpuscope-server`` (the alert config's selectors are job matchers)."""
    match = re.fullmatch(r'job="([^"]+)"', selector)
    if not match:
        raise ValueError(f"selector {selector!r} is not a single job matcher")
    return match.group(1)
