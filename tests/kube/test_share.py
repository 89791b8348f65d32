"""The share add-on (deploy/kubernetes/overlays/share): gpuscope share's controller, policy and webhook.

Rendered as kustomize renders it, validated offline like the overlays (Kubernetes' OpenAPI schemas in
strict mode; the cert-manager and Prometheus Operator objects against their vendored CRDs), and held
to what the pods of tenants rely on: the paths and names of gpuscope.share.deploy, which the webhook
injects from.
"""

from __future__ import annotations

import copy
import shlex

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from gpuscope.contract import parts
from gpuscope.kube import share
from gpuscope.kube.config import DEPLOYMENT, image_build
from gpuscope.kube.generate import GENERATED
from gpuscope.share import deploy
from gpuscope.share.policy import parse_policy
from tests.kube.conftest import ROOT, crd_schemas, rendered
from tests.kube.test_validate import KUBERNETES_VERSIONS

ADDON = "share"


def _objects() -> tuple[dict, ...]:
    return rendered(ADDON)


def _one(kind: str, name: str) -> dict:
    matches = [o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{len(matches)} {kind}/{name}"
    return matches[0]


def _pod(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _controller() -> tuple[dict, dict]:
    ds = _one("DaemonSet", share.CONTROLLER)
    (container,) = _pod(ds)["containers"]
    return _pod(ds), container


def test_the_addon_renders_every_object_once() -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in _objects())
    assert kinds == sorted([
        ("ConfigMap", share.POLICY_CONFIGMAP), ("DaemonSet", share.CONTROLLER), ("Service", share.CONTROLLER),
        ("ServiceMonitor", share.CONTROLLER), ("Deployment", share.WEBHOOK), ("Service", share.WEBHOOK),
        ("ServiceMonitor", share.WEBHOOK),
        ("PodDisruptionBudget", share.WEBHOOK), ("MutatingWebhookConfiguration", share.WEBHOOK_CONFIGURATION),
        ("Issuer", share.ISSUER), ("Certificate", share.CERTIFICATE)])
    for obj in _objects():
        if obj["kind"] != "MutatingWebhookConfiguration":  # cluster-scoped
            assert obj["metadata"]["namespace"] == DEPLOYMENT.cluster.namespace, obj["metadata"]["name"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_objects_validate_against_the_openapi_schemas(version: str) -> None:
    checked = 0
    for obj in _objects():
        if (obj["apiVersion"], obj["kind"]) in crd_schemas():
            continue
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except SchemaNotFoundError:
            pytest.fail(f"{where}: no Kubernetes {version} schema for {obj['apiVersion']} {obj['kind']}")
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} (Kubernetes {version}): {'.'.join(map(str, exc.path))}: {exc.message}")
        checked += 1
    assert checked == 7


def test_custom_resources_validate_against_their_crds() -> None:
    kinds = set()
    for obj in _objects():
        schema = crd_schemas().get((obj["apiVersion"], obj["kind"]))
        if schema is None:
            continue
        try:
            jsonschema.validate(obj, schema, cls=jsonschema.Draft202012Validator)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, exc.absolute_path))}: "
                        f"{exc.message}")
        kinds.add(obj["kind"])
    assert kinds == {"ServiceMonitor", "Issuer", "Certificate"}


def test_broken_objects_fail_validation() -> None:
    webhooks = copy.deepcopy(_one("MutatingWebhookConfiguration", share.WEBHOOK_CONFIGURATION))
    webhooks["webhooks"][0]["timeoutSeconds"] = "5s"  # must be an integer
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(webhooks, KUBERNETES_VERSIONS[-1], strict=True)
    ds = copy.deepcopy(_one("DaemonSet", share.CONTROLLER))
    _pod(ds)["hostPid"] = True  # the field is hostPID
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBERNETES_VERSIONS[-1], strict=True)
    cert = copy.deepcopy(_one("Certificate", share.CERTIFICATE))
    cert["spec"]["privateKey"]["algorithm"] = "DSA"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cert, crd_schemas()[("cert-manager.io/v1", "Certificate")],
                            cls=jsonschema.Draft202012Validator)
    issuer = copy.deepcopy(_one("Issuer", share.ISSUER))
    issuer["spec"]["selfsigned"] = issuer["spec"].pop("selfSigned")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(issuer, crd_schemas()[("cert-manager.io/v1", "Issuer")],
                            cls=jsonschema.Draft202012Validator)


# --- the controller ---------------------------------------------------------------------------------------

def test_controller_runs_on_gpu_nodes_with_nvml_and_no_gpu_claimed() -> None:
    pod, c = _controller()
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"}
    assert not any(k.startswith("nvidia.com/") for part in c["resources"].values() for k in part)
    assert {"cpu", "memory"} <= c["resources"]["requests"].keys() <= c["resources"]["limits"].keys()


def test_controller_privileges_are_the_ones_it_needs_and_no_more() -> None:
    pod, c = _controller()
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert pod["securityContext"] == {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert pod["automountServiceAccountToken"] is False
    host_paths = [v for v in pod["volumes"] if "hostPath" in v]
    assert host_paths == [{"name": deploy.VOLUME,
                           "hostPath": {"path": deploy.NODE_DIR, "type": "DirectoryOrCreate"}}]


def test_every_privilege_is_explained_in_the_generated_daemonset() -> None:
    text = (ROOT / GENERATED / "share" / "controller.yaml").read_text()
    lines = text.splitlines()
    for key in ("hostPID: true", "runAsUser: 0", "runtimeClassName: nvidia", "hostPath:"):
        at = next(i for i, line in enumerate(lines) if line.lstrip(" -").startswith(key))
        assert lines[at - 1].lstrip().startswith("#"), f"{key} has no comment saying why"


def test_controller_command_copies_the_library_and_runs_on_deploys_paths() -> None:
    pod, c = _controller()
    assert c["command"][:2] == ["/bin/sh", "-c"]
    script = c["command"][2]
    steps = [shlex.split(line) for line in script.strip().splitlines()]
    assert steps[0] == ["set", "-eu"]
    # the library: a new file renamed over the old one (a tenant that has it mapped keeps its copy)
    assert ["cp", "$(python -m gpuscope.share.preload)", f"{deploy.LIBRARY}.new"] in steps
    assert ["mv", "-f", f"{deploy.LIBRARY}.new", deploy.LIBRARY] in steps
    assert ["chmod", "0755", deploy.NODE_DIR] in steps
    exec_line = steps[-1]
    assert exec_line == ["exec", "gpuscope", "share", "--share.policy-file", deploy.POLICY_FILE,
                         "--share.ledger", deploy.LEDGER,
                         "--web.listen-address", f"0.0.0.0:{parts.SHARE_PORT}"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts[deploy.NODE_DIR]["name"] == deploy.VOLUME and not mounts[deploy.NODE_DIR].get("readOnly")
    for path in (deploy.LEDGER, deploy.LIBRARY):
        assert path.startswith(deploy.NODE_DIR + "/")
    policy_dir = deploy.POLICY_FILE.rsplit("/", 1)[0]
    assert mounts[policy_dir]["readOnly"] is True and "subPath" not in mounts[policy_dir]  # updates arrive
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[policy_dir]["name"])
    assert volume["configMap"]["name"] == share.POLICY_CONFIGMAP
    assert volume["configMap"]["items"] == [{"key": deploy.POLICY_KEY, "path": deploy.POLICY_KEY}]
    assert "/tmp" in mounts  # HOME=/tmp in the image, root filesystem read-only
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["ports"] == [{"name": "metrics", "containerPort": parts.SHARE_PORT}]


def test_the_example_policy_is_a_valid_policy_of_two_tenants() -> None:
    cm = _one("ConfigMap", share.POLICY_CONFIGMAP)
    spec = parse_policy(cm["data"][deploy.POLICY_KEY])
    assert [t.name for t in spec.tenants] == list(share.EXAMPLE_UIDS)
    assert {name: [str(r.value) for r in rules] for name, rules in spec.allow.items()} == {
        name: [str(uid)] for name, uid in share.EXAMPLE_UIDS.items()}


def test_controller_is_scraped_as_the_share_job() -> None:
    svc = _one("Service", share.CONTROLLER)
    monitor = _one("ServiceMonitor", share.CONTROLLER)
    assert share.CONTROLLER == parts.SHARE.job == "gpuscope-share"
    (endpoint,) = monitor["spec"]["endpoints"]
    job = {"action": "replace", "targetLabel": "job", "replacement": parts.SHARE.job}
    assert job in endpoint["relabelings"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == DEPLOYMENT.cluster.release
    pod_labels = _one("DaemonSet", share.CONTROLLER)["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["port"] == parts.SHARE_PORT


# --- the webhook ------------------------------------------------------------------------------------------

def test_webhook_fails_open_and_sees_only_labelled_namespaces() -> None:
    config = _one("MutatingWebhookConfiguration", share.WEBHOOK_CONFIGURATION)
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["timeoutSeconds"] <= 5
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    label = {deploy.NAMESPACE_LABEL: deploy.NAMESPACE_LABEL_VALUE}
    assert hook["namespaceSelector"] == {"matchLabels": label}
    ns = DEPLOYMENT.cluster.namespace
    assert hook["clientConfig"] == {"service": {"name": share.WEBHOOK, "namespace": ns,
                                                "path": deploy.WEBHOOK_PATH, "port": 443}}
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{ns}/{share.CERTIFICATE}"


def test_webhook_serves_tls_from_the_certificate_behind_its_service() -> None:
    dep = _one("Deployment", share.WEBHOOK)
    pod = _pod(dep)
    (c,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2
    assert c["args"] == ["share-webhook", "--web.listen-address", f"0.0.0.0:{deploy.WEBHOOK_PORT}",
                         "--web.tls-cert", "/tls/tls.crt", "--web.tls-key", "/tls/tls.key"]
    assert c["image"] == f"gpuscope:{image_build(ROOT).tag}"
    assert c["ports"] == [{"name": "https", "containerPort": deploy.WEBHOOK_PORT}]
    tls = next(m for m in c["volumeMounts"] if m["mountPath"] == share.TLS_DIR)
    assert tls["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == tls["name"])
    cert = _one("Certificate", share.CERTIFICATE)
    assert volume["secret"]["secretName"] == cert["spec"]["secretName"]
    assert cert["spec"]["issuerRef"] == {"name": share.ISSUER, "kind": "Issuer", "group": "cert-manager.io"}
    assert _one("Issuer", share.ISSUER)["spec"] == {"selfSigned": {}}
    svc = _one("Service", share.WEBHOOK)
    assert svc["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "https"}]
    assert svc["spec"]["selector"].items() <= pod_labels(dep).items()
    assert f"{share.WEBHOOK}.{DEPLOYMENT.cluster.namespace}.svc" in cert["spec"]["dnsNames"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    pdb = _one("PodDisruptionBudget", share.WEBHOOK)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(dep).items()


def test_webhook_is_scraped_over_its_tls_with_the_certificates_ca() -> None:
    svc = _one("Service", share.WEBHOOK)
    monitor = _one("ServiceMonitor", share.WEBHOOK)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert (endpoint["scheme"], endpoint["path"]) == ("https", "/metrics")
    cert = _one("Certificate", share.CERTIFICATE)
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": cert["spec"]["secretName"], "key": "ca.crt"}},
                                     "serverName": cert["spec"]["commonName"]}
    assert endpoint["tlsConfig"]["serverName"] in cert["spec"]["dnsNames"]
    job = {"action": "replace", "targetLabel": "job", "replacement": share.WEBHOOK}
    assert job in endpoint["relabelings"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == DEPLOYMENT.cluster.release


def pod_labels(obj: dict) -> dict:
    return obj["spec"]["template"]["metadata"]["labels"]


def test_the_overlay_adds_the_generated_folder_with_the_cpu_image() -> None:
    overlay = yaml.safe_load((ROOT / "deploy/kubernetes/overlays/share/kustomization.yaml").read_text())
    assert overlay["resources"] == ["../../generated/share"]
    assert overlay["components"] == ["../../generated/images/cpu"]
    _, c = _controller()
    assert c["image"] == f"gpuscope:{image_build(ROOT).tag}"
