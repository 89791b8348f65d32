"""Every rendered object validates against its published schema, offline.

- Kubernetes' own kinds: the OpenAPI schemas ``kubernetes-validate`` ships, in strict mode (unknown
  fields are errors), for the oldest and the newest Kubernetes release checked here;
- ServiceMonitor and PrometheusRule: the Prometheus Operator's CRDs (vendored under schemas/, with
  their source and version), their openAPIV3Schema made strict the same way;
- prometheus-adapter's configuration: the schema transcribed from its Go config types.

A deliberately broken copy of each kind must fail, so the validation is known to bite.
"""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from gpuscope.kube.config import DEPLOYMENT
from tests.kube.conftest import adapter_schema, all_rendered, crd_schemas, find

#: The oldest Kubernetes release still validated (HPA autoscaling/v2 behavior, sidecar-free probes,
#: seccompProfile fields all exist from here) and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())


def _validate_core(obj: dict, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def _validate_crd(obj: dict) -> None:
    schema = crd_schemas()[(obj["apiVersion"], obj["kind"])]
    jsonschema.validate(obj, schema, cls=jsonschema.Draft202012Validator)


def _is_custom(obj: dict) -> bool:
    return (obj["apiVersion"], obj["kind"]) in crd_schemas()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_objects_validate_against_the_openapi_schemas(version: str) -> None:
    checked = 0
    for overlay, obj in all_rendered():
        if _is_custom(obj):
            continue
        where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            _validate_core(obj, version)
        except SchemaNotFoundError:
            pytest.fail(f"{where}: no Kubernetes {version} schema for {obj['apiVersion']} {obj['kind']}")
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} (Kubernetes {version}): {'.'.join(map(str, exc.path))}: {exc.message}")
        checked += 1
    assert checked >= 30


def test_custom_resources_validate_against_the_operator_crds() -> None:
    kinds = set()
    for overlay, obj in all_rendered():
        if _is_custom(obj):
            try:
                _validate_crd(obj)
            except jsonschema.ValidationError as exc:
                pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: "
                            f"{'.'.join(map(str, exc.absolute_path))}: {exc.message}")
            kinds.add(obj["kind"])
    assert kinds == {"PrometheusRule", "ServiceMonitor"}
    known = {kind for _, kind in crd_schemas()}
    unknown = {o["kind"] for _, o in all_rendered() if o["apiVersion"].startswith("monitoring.coreos.com")}
    assert unknown <= known, f"no vendored CRD for {unknown - known}"


def test_prometheus_adapter_config_validates() -> None:
    cm = find("gpu", "ConfigMap", DEPLOYMENT.names.adapter_config)
    config = yaml.safe_load(cm["data"]["config.yaml"])
    jsonschema.validate(config, adapter_schema(), cls=jsonschema.Draft202012Validator)
    assert len(config["rules"]) == 2


# --- the validation bites ----------------------------------------------------------------------------------

def test_an_unknown_field_fails_kubernetes_validation() -> None:
    daemonset = copy.deepcopy(find("gpu", "DaemonSet", DEPLOYMENT.names.exporter))
    daemonset["spec"]["template"]["spec"]["runtimeClass"] = "nvidia"  # the field is runtimeClassName
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_core(daemonset, KUBERNETES_VERSIONS[-1])
    hpa = copy.deepcopy(find("gpu", "HorizontalPodAutoscaler", DEPLOYMENT.names.hpa))
    hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] = "10m"  # must be an integer
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_core(hpa, KUBERNETES_VERSIONS[-1])


def test_broken_custom_resources_fail_the_crd_schemas() -> None:
    monitor = copy.deepcopy(find("gpu", "ServiceMonitor", DEPLOYMENT.names.exporter))
    monitor["spec"]["endpoints"][0]["relabelings"][0]["action"] = "rename"  # not a relabel action
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd(monitor)
    monitor = copy.deepcopy(find("gpu", "ServiceMonitor", DEPLOYMENT.names.server))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd(monitor)
    rule = copy.deepcopy(find("gpu", "PrometheusRule", DEPLOYMENT.names.prometheus_rule))
    rule["spec"]["groups"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd(rule)


def test_a_broken_adapter_config_fails_its_schema() -> None:
    cm = find("gpu", "ConfigMap", DEPLOYMENT.names.adapter_config)
    config = yaml.safe_load(cm["data"]["config.yaml"])
    config["rules"][0]["metricQuery"] = config["rules"][0].pop("metricsQuery")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, adapter_schema(), cls=jsonschema.Draft202012Validator)
