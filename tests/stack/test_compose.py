"""docker-compose.yml without a Docker engine: `docker-compose config`, mounts, ports, images, configs.

Every file the compose file mounts must exist and be one that a test here validates; the mapping
below says which test validates which file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuscope.contract import parts
from gpuscope.contract.parts import PORTS
from gpuscope.ops.stack import Stack, StackOptions
from gpuscope.share import deploy
from gpuscope.share.policy import parse_policy
from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"

#: Every repository path the compose file mounts, and the test that validates it.
VALIDATED = {
    "deploy/otel-collector/config.yaml": "tests/stack/test_tracing_configs.py (generated from the alert "
                                         "config; documented keys; pipelines)",
    "deploy/tempo/tempo.yml": "tests/stack/test_tracing_configs.py (documented keys, ports, paths)",
    "deploy/prometheus/prometheus.yml": "test_prometheus_config_passes_promtool, "
                                        "test_prometheus_jobs_and_ports",
    "alerts/prometheus/production": "test_rendered_stack_configs_pass_promtool_and_amtool (promtool "
                                    "loads the rules); tests/alerts/cases via promtool test rules",
    "alerts/alertmanager.yml": "test_rendered_stack_configs_pass_promtool_and_amtool (amtool check-config)",
    "alerts/loki/production": "tests/dashboards/test_logql.py (Grafana's LogQL grammar), test_loki_config",
    "deploy/loki/loki.yml": "test_loki_config",
    "deploy/grafana/provisioning": "tests/dashboards/test_structure.py (datasource uids), "
                                   "test_grafana_provisioning_matches_mounts",
    "dashboards/json": "tests/dashboards (structure, regeneration, every query against live Prometheus)",
    "deploy/share": "test_share_profile (a valid gpuscope share policy, mounted where the controller "
                    "reads it)",
}
#: Host paths mounted read-only for node_exporter.
HOST_MOUNTS = {"/proc", "/sys"}


def compose_config(*files: Path, profile: str | tuple[str, ...] | None = None,
                   password: str | None = "test-only", check: bool = True) -> subprocess.CompletedProcess:
    binary = require_binary("docker-compose")
    env = {"PATH": "/usr/bin:/bin"}
    if password is not None:
        env["GF_ADMIN_PASSWORD"] = password
    argv = [binary, "--project-directory", str(ROOT)]
    for f in files or (COMPOSE,):
        argv += ["-f", str(f)]
    for name in (profile,) if isinstance(profile, str) else profile or ():
        argv += ["--profile", name]
    result = subprocess.run([*argv, "config"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def resolved() -> dict:
    return yaml.safe_load(compose_config(profile=("loadtest", "share")).stdout)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_config_passes_for_cpu_gpu_and_loadtest():
    compose_config()
    gpu = yaml.safe_load(compose_config(COMPOSE, GPU_OVERRIDE).stdout)["services"]
    for name in ("server", "exporter"):
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "cu" in gpu["server"]["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[-1]
    loadtest = yaml.safe_load(compose_config(profile="loadtest").stdout)["services"]
    assert {"locust-master", "locust-worker"} <= loadtest.keys()


def test_no_default_grafana_password():
    result = compose_config(password=None, check=False)
    assert result.returncode != 0
    assert "GF_ADMIN_PASSWORD" in result.stderr
    assert re.search(r"GF_SECURITY_ADMIN_PASSWORD: \$\{GF_ADMIN_PASSWORD:\?", COMPOSE.read_text())


def test_services(resolved):
    services = resolved["services"]
    assert {"server", "exporter", "node-exporter", "prometheus", "alertmanager", "loki", "grafana",
            "receiver", "locust-master", "locust-worker", *SHARE_SERVICES} <= services.keys()
    for name in ("server", "exporter", "receiver", "locust-master", "locust-worker", *SHARE_SERVICES):
        assert services[name]["build"]["context"] == str(ROOT), f"{name} is built from this repository"
    assert services["locust-master"]["command"][:3] == ["-f", "/app/loadtest/", "--master"]
    assert services["locust-worker"]["command"][:3] == ["-f", "/app/loadtest/", "--worker"]
    for name, service in services.items():
        if not name.startswith("locust"):
            assert "healthcheck" in service, f"{name} has no healthcheck"
        for dep, cond in service.get("depends_on", {}).items():
            assert cond["condition"] in ("service_healthy", "service_started"), (name, dep)


def _bind_mounts(service: dict) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2] if isinstance(volume, str) else (volume["source"],
                                                                                volume["target"])
        if source.startswith("/"):
            mounts.append((source, target))
    return mounts


def test_every_mount_exists_and_is_validated(resolved):
    mounted = set()
    for name, service in resolved["services"].items():
        for source, _ in _bind_mounts(service):
            if source in HOST_MOUNTS:
                assert name == "node-exporter", f"{name} mounts host path {source}"
                continue
            path = Path(source)
            rel = path.relative_to(ROOT).as_posix()
            assert path.exists(), f"{name} mounts {rel}, which does not exist"
            assert rel in VALIDATED, f"{name} mounts {rel}, which no test validates: add one"
            mounted.add(rel)
    assert mounted == set(VALIDATED), f"validated but not mounted: {set(VALIDATED) - mounted}"


def test_named_volumes_for_data(resolved):
    assert {"prometheus-data", "alertmanager-data", "loki-data", "grafana-data",
            "share-ledger"} <= resolved["volumes"].keys()


def test_ports_match_the_ports_module(resolved):
    services = resolved["services"]
    for name, port in PORTS.items():
        service = services.get(name) or services[f"{name}-master"]
        text = " ".join(map(str, service.get("command", []))) + " " + str(service.get("healthcheck", ""))
        if name not in ("grafana", "loki"):  # their ports come from the image default and loki.yml
            assert re.search(rf"(0\.0\.0\.0:|--web-port ){port}\b", text), f"{name} does not listen on {port}"
        for published in service.get("ports", []):
            assert re.fullmatch(rf"\$?[\w{{}}:.-]*127\.0\.0\.1:{port}:{port}(/tcp)?", published), published
    loki = yaml.safe_load((ROOT / "deploy" / "loki" / "loki.yml").read_text())
    assert loki["server"]["http_listen_port"] == PORTS["loki"]


def test_host_ports_local_unless_asked(raw):
    for name, service in raw["services"].items():
        for published in service.get("ports", []):
            assert published.startswith("${GPUSCOPE_BIND:-127.0.0.1}:"), f"{name} publishes {published}"
    published = {name for name, s in raw["services"].items() if s.get("ports")}
    assert published == {"server", "prometheus", "alertmanager", "grafana", "locust-master"}


def test_images_pinned_in_one_place(raw, resolved):
    versions = raw["x-versions"]
    for name, service in resolved["services"].items():
        image = service["image"]
        if image.startswith("gpuscope:"):
            continue
        assert image in versions.values(), f"{name}: {image} is not from x-versions"
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: {image} is not pinned to a release"
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "scripts" / "test.sh").read_text()).group(1)
    assert versions["torch"] == pinned, "torch pin differs from scripts/test.sh"
    args = resolved["services"]["server"]["build"]["args"]
    assert args["PYTHON_IMAGE"] == versions["python"] and args["TORCH_VERSION"] == versions["torch"]


def test_dockerfile_runs_as_non_root_and_installs_the_server_extra():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", text, re.M)
    assert re.search(r"^USER 10001$", text, re.M)
    # kubernetes: grpcio for the exporter's pod attribution; tracing: the server's OTLP spans.
    assert 'pip install ".[server,loadtest,kubernetes,tracing]"' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"!src/", "!loadtest/", "!pyproject.toml", "!setup.py"} <= set(ignored)
    # The timer's C hot path is built in the image (the build fails rather than ship the fallback).
    assert re.search(r"^COPY pyproject.toml setup.py README.md \./$", text, re.M)
    assert "hot.native_available()" in text


def test_prometheus_config_passes_promtool():
    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "check", "config", "--syntax-only",
                             str(ROOT / "deploy" / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_scrape_job_of_the_single_host_config_has_the_same_host_label():
    """Server, GPU and node series of one machine meet on ``host`` (bottleneck rules, diagnose
    --prometheus): a job without it would be a second host."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    hosts = {}
    for job in config["scrape_configs"]:
        if "static_configs" in job:
            hosts[job["job_name"]] = {(group.get("labels") or {}).get("host")
                                      for group in job["static_configs"]}
        else:  # discovered targets: the label is set by relabelling
            hosts[job["job_name"]] = {r["replacement"] for r in job["relabel_configs"]
                                      if r["target_label"] == "host"}
    assert set().union(*hosts.values()) == {"local"}, hosts


def test_prometheus_jobs_and_ports():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {}
    for job in config["scrape_configs"]:
        if job["job_name"] == parts.SHARE.job:
            continue  # a compose profile's service, found by DNS: test_share_profile
        (group,) = job["static_configs"]
        (target,) = group["targets"]
        jobs[job["job_name"]] = target
    assert jobs == {
        "gpuscope-server": f"server:{PORTS['server']}",
        "gpuscope-exporter": f"exporter:{PORTS['exporter']}",
        "node": f"node-exporter:{PORTS['node-exporter']}",
        "gpuscope-receiver": f"receiver:{PORTS['receiver']}",
        "prometheus": f"prometheus:{PORTS['prometheus']}",
        "alertmanager": f"alertmanager:{PORTS['alertmanager']}",
    }
    assert config["global"]["scrape_interval"] == "5s"
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        f"alertmanager:{PORTS['alertmanager']}"]


@pytest.mark.parametrize("profile", ["production", "test"])
def test_rendered_stack_configs_pass_promtool_and_amtool(tmp_path, profile):
    """The no-Docker stack's configs: the compose ones with local addresses, loading the real rules."""
    promtool, amtool = require_binary("promtool"), require_binary("amtool")
    stack = Stack(StackOptions(profile=profile, ports="free", run_dir=tmp_path), log=lambda line: None)
    stack.render_configs()
    prom, am = tmp_path / "prometheus.yml", tmp_path / "alertmanager.yml"
    result = subprocess.run([promtool, "check", "config", str(prom)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout + result.stderr)
    result = subprocess.run([amtool, "check-config", str(am)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    for path in (prom, am):
        text = path.read_text()
        for service, port in PORTS.items():
            assert not re.search(rf"(?<![\w.-]){service}:{port}\b", text), f"{service}:{port} left in {path}"
    assert stack.url("receiver").removeprefix("http://") + "/alerts" in am.read_text()


def test_loki_config(resolved):
    config = yaml.safe_load((ROOT / "deploy" / "loki" / "loki.yml").read_text())
    assert config["auth_enabled"] is False  # → tenant "fake"
    (schema,) = config["schema_config"]["configs"]
    assert (schema["store"], schema["schema"], schema["object_store"]) == ("tsdb", "v13", "filesystem")
    assert config["limits_config"]["allow_structured_metadata"] is True
    ruler = config["ruler"]
    assert ruler["alertmanager_url"] == f"http://alertmanager:{PORTS['alertmanager']}"
    rules_dir = ruler["storage"]["local"]["directory"]
    mounts = dict((t, s) for s, t in _bind_mounts(resolved["services"]["loki"]))
    assert mounts[rules_dir] == str(ROOT / "alerts" / "loki" / "production")
    assert list((ROOT / "alerts" / "loki" / "production" / "fake").glob("*.yml")), "no rules for tenant fake"


def test_grafana_provisioning_matches_mounts(resolved):
    grafana = resolved["services"]["grafana"]
    mounts = dict((t, s) for s, t in _bind_mounts(grafana))
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/gpuscope.yml").read_text())
    (prov,) = provider["providers"]
    assert mounts[prov["options"]["path"]] == str(ROOT / "dashboards" / "json")
    assert mounts["/etc/grafana/provisioning"] == str(ROOT / "deploy" / "grafana" / "provisioning")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "dashboards" / "json" / Path(home).name).exists()


# --- the share profile --------------------------------------------------------------------------------------

SHARE_SERVICES = ("share", "share-online", "share-batch")
#: Where the Dockerfile links the preload library for tenants' LD_PRELOAD.
IMAGE_LIBRARY = "/usr/local/lib/libgpuscope-share.so"


def _named_mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target → (named volume, read-only)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            read_only = mode == ["ro"]
        else:
            source, target, read_only = volume["source"], volume["target"], volume.get("read_only", False)
        if not source.startswith("/"):
            out[target] = (source, read_only)
    return out


def test_share_profile(resolved):
    services = resolved["services"]
    controller = services["share"]
    for name in SHARE_SERVICES:
        assert services[name]["profiles"] == ["share"], name
    # The controller: the policy file, the ledger in the shared volume, /metrics on parts' port.
    command = controller["command"]
    assert command[0] == "share"
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags == {"--share.policy-file": deploy.POLICY_FILE, "--share.ledger": deploy.LEDGER,
                     "--web.listen-address": f"0.0.0.0:{parts.SHARE_PORT}"}
    assert f"127.0.0.1:{parts.SHARE_PORT}/healthz" in " ".join(controller["healthcheck"]["test"])
    assert controller["pid"] == "host"
    assert not controller.get("ports")
    mounts = dict((t, s) for s, t in _bind_mounts(controller))
    policy_dir = deploy.POLICY_FILE.rsplit("/", 1)[0]
    assert mounts[policy_dir] == str(ROOT / "deploy" / "share")  # the folder: a replaced file is seen
    policy = parse_policy((ROOT / "deploy" / "share" / deploy.POLICY_KEY).read_text())
    assert len(policy.tenants) == 2
    ledger_dir = deploy.LEDGER.rsplit("/", 1)[0]
    assert _named_mounts(controller)[ledger_dir] == ("share-ledger", False)
    # The tenants: the library the image ships, the environment the webhook gives a pod, the volume read-only.
    tenants = {}
    for name in ("share-online", "share-batch"):
        tenant = services[name]
        env = tenant["environment"]
        tenants[name] = env["GPUSCOPE_SHARE_TENANT"]
        assert env == {"LD_PRELOAD": IMAGE_LIBRARY, **deploy.tenant_environment(env["GPUSCOPE_SHARE_TENANT"])}
        assert _named_mounts(tenant)[ledger_dir] == ("share-ledger", True)
        assert tenant["entrypoint"] == ["python", "-m", "gpuscope.share.demo"]
        assert tenant["depends_on"] == {"share": {"condition": "service_healthy"}}
        assert "pid" not in tenant
    assert sorted(tenants.values()) == sorted(t.name for t in policy.tenants)


def test_share_profile_with_the_gpu_override():
    services = yaml.safe_load(compose_config(COMPOSE, GPU_OVERRIDE, profile="share").stdout)["services"]
    (device,) = services["share"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == "all" and "utility" in device["capabilities"]  # NVML of every GPU
    assert services["share"]["image"] == "gpuscope:local"  # NVML only: the CPU build
    for name in ("share-online", "share-batch"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0"] and "gpu" in device["capabilities"]  # both on one GPU
        assert services[name]["image"] == "gpuscope:local-cuda"
        assert "cu" in services[name]["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[-1]


def test_share_scrape_job_has_no_target_without_the_profile(tmp_path):
    """Prometheus finds the controller through Docker's DNS: a name that does not resolve (NXDOMAIN) is
    no target at all, not a target down. `gpuscope stack` runs no controller and leaves the job out."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == parts.SHARE.job)
    assert "static_configs" not in job
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["share"] and sd["type"] == "A" and sd["port"] == parts.SHARE_PORT
    stack = Stack(StackOptions(profile="production", ports="free", run_dir=tmp_path), log=lambda line: None)
    stack.render_configs()
    rendered = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    assert parts.SHARE.job not in {j["job_name"] for j in rendered["scrape_configs"]}


def test_dockerfile_ships_the_share_library_at_a_fixed_path():
    text = (ROOT / "Dockerfile").read_text()
    assert "assert library_path(), 'share preload library not built'" in text
    assert f'ln -s "$(python -m gpuscope.share.preload)" {IMAGE_LIBRARY}' in text
    assert f"install -d -m 0755 -o 10001 -g 10001 {deploy.NODE_DIR}" in text
    # built before gcc leaves, in the same layer
    assert text.index("library_path()") < text.index("apt-get purge -y gcc")
