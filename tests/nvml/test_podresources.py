"""Pod attribution: the exporter asks a kubelet's PodResources API which container holds each GPU.

The kubelet here is a real gRPC server on a unix socket in a temporary directory, implementing
``v1.PodResourcesLister`` from the vendored ``api.proto`` (the generated servicer), so the exporter's
client speaks exactly the wire protocol the kubelet serves. Every wait is a deadline.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")

from gpuscope.contract import catalogue as cat  # noqa: E402
from gpuscope.nvml.config import parse  # noqa: E402
from gpuscope.nvml.devices import Device  # noqa: E402
from gpuscope.nvml.health import Health  # noqa: E402
from gpuscope.nvml.podresources import CALL, PodResourcesWatcher, device_owners  # noqa: E402
from gpuscope.nvml.podresources_v1 import api_pb2, api_pb2_grpc  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.nvml.conftest import value  # noqa: E402
from tests.nvml.fake_nvml import FakeGpu, FakeNvml, FakeProcess  # noqa: E402

GPU0, GPU1 = "GPU-00000000-fake", "GPU-00000001-fake"  # the fake NVML's UUIDs


def pod(namespace: str, name: str, *containers: tuple[str, list[tuple[str, list[str]]]]):
    return api_pb2.PodResources(
        namespace=namespace, name=name,
        containers=[api_pb2.ContainerResources(
            name=c, devices=[api_pb2.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devs])
            for c, devs in containers])


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources service, answering ``List`` with ``self.pods``."""

    def __init__(self) -> None:
        self.pods: list = []
        self.calls = 0
        self.block = threading.Event()  # set: List waits until it is cleared ... or released
        self.release = threading.Event()

    def List(self, request, context):
        self.calls += 1
        if self.block.is_set():
            self.release.wait(30)
        return api_pb2.ListPodResourcesResponse(pod_resources=self.pods)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="gs-pr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet_at() -> Iterator:
    """``kubelet_at(socket_path)`` → a started FakeKubelet serving there (stopped at teardown)."""
    servers = []

    def start(socket: Path) -> FakeKubelet:
        service = FakeKubelet()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(service, server)
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        servers.append((server, service))
        return service

    yield start
    for server, service in servers:
        service.release.set()
        server.stop(0)


def _gpu(label: str, uuid: str, mig_parent: str = "") -> Device:
    return Device(label=label, handle=None, uuid=uuid, mig_parent=mig_parent)


# --- the mapping --------------------------------------------------------------------------------------

def test_device_ids_map_to_the_one_container_holding_them() -> None:
    owners = device_owners([
        pod("team-a", "llm-0", ("server", [("nvidia.com/gpu", [GPU0])]),
            ("sidecar", [("example.com/fpga", ["fpga0"])])),  # other vendors' devices are ignored
        pod("team-b", "mig-job", ("worker", [("nvidia.com/mig-1g.18gb", ["MIG-aaaa"])])),
        pod("team-c", "single", ("worker", [("nvidia.com/gpu", ["MIG-bbbb"])])),  # MIG, single strategy
    ])
    assert owners == {GPU0: ("team-a", "llm-0", "server"), "MIG-aaaa": ("team-b", "mig-job", "worker"),
                      "MIG-bbbb": ("team-c", "single", "worker")}


def test_a_gpu_shared_by_several_containers_gets_no_owner() -> None:
    # Time-slicing: the device plugin hands out replicas <uuid>::<n> of one GPU.
    owners = device_owners([
        pod("a", "p1", ("c", [("nvidia.com/gpu", [f"{GPU0}::0"])])),
        pod("b", "p2", ("c", [("nvidia.com/gpu", [f"{GPU0}::1"])])),
        pod("a", "p3", ("c", [("nvidia.com/gpu", [f"{GPU1}::0", f"{GPU1}::3"])])),  # two replicas, one holder
    ])
    assert owners == {GPU0: None, GPU1: ("a", "p3", "c")}


def test_lookup_by_uuid_and_by_index_for_whole_gpus() -> None:
    watcher = PodResourcesWatcher("/nonexistent", Health())
    watcher._owners = {GPU0: ("a", "p", "c"), "1": ("b", "q", "d"), "MIG-x": ("e", "f", "g"),
                       "0": ("z", "z", "z")}
    assert watcher.owner(_gpu("0", GPU0)) == ("a", "p", "c")  # the UUID wins over the index
    assert watcher.owner(_gpu("1", GPU1)) == ("b", "q", "d")  # deviceIDStrategy: index
    assert watcher.owner(_gpu("0/gi1/ci0", "MIG-x", mig_parent="0")) == ("e", "f", "g")
    assert watcher.owner(_gpu("0/gi2/ci0", "MIG-y", mig_parent="0")) is None


# --- the watcher against a kubelet ----------------------------------------------------------------------

def test_watcher_reads_the_kubelet_over_its_socket(socket_dir, kubelet_at) -> None:
    socket = socket_dir / "kubelet.sock"
    kubelet = kubelet_at(socket)
    kubelet.pods = [pod("ml", "llm-7f9", ("server", [("nvidia.com/gpu", [GPU1])]))]
    health = Health()
    watcher = PodResourcesWatcher(str(socket), health, interval=0.05)
    assert watcher.refresh()
    assert watcher.owner(_gpu("1", GPU1)) == ("ml", "llm-7f9", "server")
    assert watcher.owner(_gpu("0", GPU0)) is None
    kubelet.pods = []  # the pod ended
    assert watcher.refresh()
    assert watcher.owner(_gpu("1", GPU1)) is None
    assert kubelet.calls == 2 and health.errors() == {}
    watcher.join(1)


def test_a_call_past_its_timeout_fails_once_and_keeps_the_map_for_a_while(socket_dir, kubelet_at) -> None:
    socket = socket_dir / "kubelet.sock"
    kubelet = kubelet_at(socket)
    kubelet.pods = [pod("ml", "llm", ("server", [("nvidia.com/gpu", [GPU0])]))]
    now = [100.0]
    health = Health()
    # A generous timeout for the calls that must succeed (a loaded CI machine is slow), a short one
    # while the kubelet hangs.
    watcher = PodResourcesWatcher(str(socket), health, interval=1.0, timeout=30.0, max_age=30.0,
                                  clock=lambda: now[0])
    assert watcher.refresh()
    kubelet.block.set()  # the kubelet hangs
    watcher.timeout = 0.3
    assert not watcher.refresh()
    assert not watcher.refresh()
    assert health.errors() == {CALL: 1}  # one outage, counted once
    assert watcher.owner(_gpu("0", GPU0)) == ("ml", "llm", "server")  # a short outage keeps the map
    now[0] += 31.0
    assert not watcher.refresh()
    assert watcher.owner(_gpu("0", GPU0)) is None  # too old to serve
    kubelet.block.clear()
    kubelet.release.set()
    watcher.timeout = 30.0
    assert watcher.refresh()
    assert watcher.owner(_gpu("0", GPU0)) == ("ml", "llm", "server")
    kubelet.block.set()
    kubelet.release.clear()
    watcher.timeout = 0.3
    assert not watcher.refresh()
    assert health.errors() == {CALL: 2}  # a new outage after recovery counts again
    kubelet.release.set()
    watcher.join(1)


def test_without_grpcio_the_watcher_counts_once_and_stops(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "grpc", None)  # import grpc raises ImportError
    health = Health()
    watcher = PodResourcesWatcher("/nonexistent/kubelet.sock", health, interval=0.01).start()
    wait_for(lambda: not watcher._thread.is_alive(), what="the watcher thread to give up")
    assert watcher.attempts == 1 and health.errors() == {CALL: 1}


# --- the exporter ------------------------------------------------------------------------------------------

def test_exporter_labels_gpu_and_process_series_with_the_pod(socket_dir, kubelet_at, start_exporter) -> None:
    socket = socket_dir / "kubelet.sock"
    kubelet = kubelet_at(socket)
    kubelet.pods = [pod("ml", "llm-0", ("server", [("nvidia.com/gpu", [GPU0])]))]
    nv = FakeNvml([FakeGpu(processes=[FakeProcess(4242, 2**30)]), FakeGpu()])
    ex = start_exporter(nv, pod_resources_socket=str(socket),
                        collectors=frozenset({"device", "energy", "processes"}))
    owned = {"namespace": "ml", "pod": "llm-0", "container": "server"}
    nobody = {"namespace": "", "pod": "", "container": ""}
    wait_for(lambda: value(ex, cat.GPU_UTILIZATION.name, gpu="0", **owned) == 0.5, what="pod labels on gpu 0")
    wait_for(lambda: value(ex, cat.GPU_ENERGY.name, gpu="0", **owned) is not None, what="slow collector")
    wait_for(lambda: value(ex, cat.GPU_PROCESS_MEMORY.name, gpu="0", pid="4242", process="", container_id="",
                           **owned) == 2**30, what="pod labels on the process series")
    assert value(ex, cat.GPU_UTILIZATION.name, gpu="1", **nobody) == 0.5
    assert value(ex, cat.GPU_UTILIZATION.name, gpu="0") is None  # every series has the labels
    assert value(ex, cat.EXPORTER_GPU_UP.name, gpu="0") == 1  # exporter health stays unlabelled
    line = b'gpuscope_gpu_power_watts{container="server",gpu="0",namespace="ml",pod="llm-0"} 120.0'
    wait_for(lambda: line in ex.metrics("text/plain")[0], what="the labels on /metrics")
    # The pod moves to the other GPU: labels follow within a refresh and a round.
    kubelet.pods = [pod("ml", "llm-0", ("server", [("nvidia.com/gpu", [GPU1])]))]
    wait_for(lambda: value(ex, cat.GPU_UTILIZATION.name, gpu="1", **owned) == 0.5, what="labels moved")
    wait_for(lambda: value(ex, cat.GPU_UTILIZATION.name, gpu="0", **nobody) == 0.5)


def test_exporter_without_the_socket_counts_once_and_picks_it_up_later(socket_dir, kubelet_at,
                                                                       start_exporter) -> None:
    socket = socket_dir / "kubelet.sock"  # nothing there yet
    ex = start_exporter(FakeNvml([FakeGpu()]), pod_resources_socket=str(socket),
                        collectors=frozenset({"device"}))
    nobody = {"namespace": "", "pod": "", "container": ""}
    wait_for(lambda: ex.pods.attempts >= 4, what="several refresh attempts")
    assert value(ex, cat.GPU_UTILIZATION.name, gpu="0", **nobody) == 0.5
    assert value(ex, cat.EXPORTER_ERRORS.name, call=CALL) == 1
    kubelet = kubelet_at(socket)  # the kubelet comes up
    kubelet.pods = [pod("ml", "llm-0", ("server", [("nvidia.com/gpu", [GPU0])]))]
    wait_for(lambda: value(ex, cat.GPU_UTILIZATION.name, gpu="0", namespace="ml", pod="llm-0",
                           container="server") == 0.5, what="labels after the kubelet came up")
    assert value(ex, cat.EXPORTER_ERRORS.name, call=CALL) == 1


def test_exporter_without_the_flag_adds_no_labels(start_exporter) -> None:
    ex = start_exporter(FakeNvml([FakeGpu()]), collectors=frozenset({"device"}))
    wait_for(lambda: value(ex, cat.GPU_UTILIZATION.name, gpu="0") == 0.5)
    assert ex.pods is None


def test_flag_and_environment_variable(monkeypatch) -> None:
    assert parse([]).pod_resources_socket == ""
    sock = "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert parse(["--kubernetes.pod-resources-socket", sock]).pod_resources_socket == sock
    monkeypatch.setenv("GPUSCOPE_KUBERNETES_POD_RESOURCES_SOCKET", "/run/k.sock")
    assert parse([]).pod_resources_socket == "/run/k.sock"


# --- the generated stubs ------------------------------------------------------------------------------------

def test_committed_stubs_are_what_the_vendored_proto_generates() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (pyproject's dev extra) regenerates the stubs")
    from gpuscope.nvml.podresources_v1 import regenerate

    for name, content in regenerate.generate().items():
        committed = (regenerate.HERE / name).read_text()
        assert committed == content, (f"{name} is stale: run python -m "
                                      "gpuscope.nvml.podresources_v1.regenerate (with the grpcio-tools "
                                      "version pinned in pyproject.toml)")


def test_the_service_is_the_kubelets() -> None:
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert service.methods_by_name["List"].output_type.full_name == "v1.ListPodResourcesResponse"
