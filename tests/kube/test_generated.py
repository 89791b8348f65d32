"""deploy/kubernetes/generated and rendered/ are current, and say what their sources say."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import yaml

from gpuscope.alerting import alertmanager
from gpuscope.alerting.generate import prometheus_rules_path, sources_rules_path
from gpuscope.contract.parts import PORTS
from gpuscope.contract.profiles import PRODUCTION
from gpuscope.kube import generate, render
from gpuscope.kube.config import DEPLOYMENT, image_build, job_of
from gpuscope.ops import generate as gpuscope_generate
from tests.kube.conftest import ROOT, find, rendered


def test_generated_files_are_current() -> None:
    stale, orphans = gpuscope_generate.run(ROOT, check=True, only=("kubernetes",))
    assert (stale, orphans) == ([], []), "run `gpuscope generate`"


def test_generate_returns_paths_under_the_generated_folder() -> None:
    files = generate.generate(ROOT)
    assert files and all(p.parts[:3] == ("deploy", "kubernetes", "generated") for p in files)


def test_renders_are_from_the_current_inputs() -> None:
    digest = render.inputs_digest(ROOT)
    for overlay in render.RENDERS:
        text = (ROOT / render.RENDERED / f"{overlay}.yaml").read_text()
        assert render.recorded_digest(text) == digest, (
            f"rendered/{overlay}.yaml is stale: run `gpuscope generate`, then "
            "python -m gpuscope.kube.render")


def test_kustomize_renders_what_is_committed() -> None:
    # kubectl is not a Debian package in a version with kustomize v5 (Debian's is 1.20); where it is
    # installed, the committed renders must be what kustomize makes of the current inputs. Elsewhere
    # the digest test above still catches any input changed since the render.
    binary = render.kubectl()
    if binary is None:
        pytest.skip("kubectl not installed: the committed renders are checked by their input digest only")
    for overlay in render.RENDERS:
        fresh = render.objects(render.kustomize(overlay, ROOT, binary))
        assert fresh == list(rendered(overlay)), f"run python -m gpuscope.kube.render ({overlay})"


def test_prometheus_rule_holds_exactly_the_production_rule_files() -> None:
    """The sources' normalisation layer, then every alert and derived series."""
    groups = [g for path in (sources_rules_path(PRODUCTION), prometheus_rules_path(PRODUCTION))
              for g in yaml.safe_load((ROOT / path).read_text())["groups"]]
    for overlay in render.OVERLAYS:
        rule = find(overlay, "PrometheusRule", DEPLOYMENT.names.prometheus_rule)
        assert rule["spec"]["groups"] == groups
        assert rule["metadata"]["labels"]["release"] == DEPLOYMENT.cluster.release


def test_alertmanager_secret_routes_as_alerts_alertmanager_yml() -> None:
    secret = find("gpu", "Secret", DEPLOYMENT.names.alertmanager_secret)
    assert secret["metadata"]["namespace"] == DEPLOYMENT.cluster.monitoring_namespace
    config = yaml.safe_load(secret["stringData"]["alertmanager.yaml"])
    url = f"http://{DEPLOYMENT.names.receiver}.{DEPLOYMENT.cluster.namespace}.svc:{PORTS['receiver']}/alerts"
    assert config == alertmanager.config(PRODUCTION, receiver_url=url)
    # The committed alerts/alertmanager.yml, with only the receiver's address different.
    committed = yaml.safe_load((ROOT / "alerts/alertmanager.yml").read_text())
    for receiver in committed["receivers"]:
        for hook in receiver["webhook_configs"]:
            hook["url"] = url
    assert config == committed


def test_dashboards_are_the_generated_json_for_the_grafana_sidecar() -> None:
    files = sorted((ROOT / "dashboards" / "json").glob("*.json"))
    maps = [o for o in rendered("gpu")
            if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]]
    assert len(maps) == len(files) == 6
    by_key = {key: (cm, text) for cm in maps for key, text in cm["data"].items()}
    for path in files:
        cm, text = by_key[path.name]
        assert text == path.read_text()
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == DEPLOYMENT.cluster.monitoring_namespace
        assert len(text.encode()) < 256 * 1024  # kubectl apply's last-applied annotation limit


def test_datasources_keep_the_dashboards_uids() -> None:
    cm = find("gpu", "ConfigMap", DEPLOYMENT.names.datasources)
    provisioning = yaml.safe_load(cm["data"]["gpuscope-datasources.yaml"])
    uids = {ds["uid"]: ds for ds in provisioning["datasources"]}
    used = set()
    for path in sorted((ROOT / "dashboards" / "json").glob("*.json")):
        text = json.dumps(json.loads(path.read_text()))
        used |= {uid for uid in ("gpuscope-prometheus", "gpuscope-alertmanager") if uid in text}
    assert used <= set(uids)
    assert uids["gpuscope-prometheus"]["url"] == DEPLOYMENT.cluster.prometheus_url
    assert not any(ds.get("isDefault") for ds in provisioning["datasources"])


def test_image_tags_come_from_pyproject_and_compose() -> None:
    build = image_build(ROOT)
    assert build.version == importlib.metadata.version("gpuscope")  # pyproject.toml's, as installed
    images = {o: {c["name"]: c["image"] for obj in rendered(o) if obj["kind"] in ("Deployment", "DaemonSet")
                  for c in obj["spec"]["template"]["spec"]["containers"]} for o in render.OVERLAYS}
    assert images["gpu"] == {"exporter": f"gpuscope:{build.tag}", "receiver": f"gpuscope:{build.tag}",
                             "server": f"gpuscope:{build.cuda_tag}"}
    assert images["cpu-demo"] == {"exporter": f"gpuscope:{build.tag}", "receiver": f"gpuscope:{build.tag}",
                                  "server": f"gpuscope:{build.tag}"}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert build.python_image == compose["x-versions"]["python"]
    assert build.torch_version == str(compose["x-versions"]["torch"])


def test_services_are_named_like_the_alert_configs_jobs() -> None:
    s = PRODUCTION.selectors
    for overlay in render.OVERLAYS:
        for selector in (s.server, s.exporter):
            service = find(overlay, "Service", job_of(selector))
            monitor = find(overlay, "ServiceMonitor", job_of(selector))
            assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
            relabel = monitor["spec"]["endpoints"][0]["relabelings"][0]
            assert relabel == {"action": "replace", "targetLabel": "job", "replacement": job_of(selector)}
