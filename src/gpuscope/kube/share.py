"""``gpuscope share`` on Kubernetes: the per-node controller, its policy, and the admission webhook.

- ``controller``: a DaemonSet on GPU nodes (NVIDIA GPU feature discovery's
  ``nvidia.com/gpu.present=true``) that keeps the node's ``gpuscope share`` folder
  (``gpuscope.share.deploy.NODE_DIR``: join socket, lock, a copy of the preload library) and holds the
  shares of the policy ConfigMap; a headless Service and a ServiceMonitor (job ``parts.SHARE.job``);
- ``webhook``: ``gpuscope share-webhook`` (a Deployment of two replicas behind a Service), the
  MutatingWebhookConfiguration that sends it the pods of namespaces labelled
  ``gpuscope.io/share=enabled`` (failing open), and its TLS from cert-manager (a self-signed Issuer and
  a Certificate whose CA cert-manager's cainjector puts into the webhook configuration).

Every path and name a tenant pod relies on comes from ``gpuscope.share.deploy``, the module the webhook
injects from. The objects carry no namespace: the share kustomization sets it, as base/ does.
"""

from __future__ import annotations

import re

from gpuscope.contract import parts
from gpuscope.kube.config import IMAGE, Deployment
from gpuscope.kube.monitoring import _job, _meta, _release
from gpuscope.share import deploy
from gpuscope.util.promql import duration

CONTROLLER = parts.SHARE.job  # gpuscope-share: the workload, its Service and ServiceMonitor
POLICY_CONFIGMAP = "gpuscope-share-policy"
WEBHOOK = "gpuscope-share-webhook"
WEBHOOK_CONFIGURATION = "gpuscope-share"
#: The webhook's name in the MutatingWebhookConfiguration (a qualified name, as the API requires).
WEBHOOK_NAME = "share.gpuscope.io"
ISSUER = "gpuscope-share-selfsigned"
CERTIFICATE = WEBHOOK
TLS_SECRET = "gpuscope-share-webhook-tls"
TLS_DIR = "/tls"
#: The API server gives up on the webhook after this, and admits the pod unchanged (failurePolicy Ignore).
WEBHOOK_TIMEOUT_S = 5
METRICS_PORT_NAME = "metrics"
WEBHOOK_PORT_NAME = "https"
GPU_NODE_LABEL = {"nvidia.com/gpu.present": "true"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
#: UIDs the example policy admits to its two tenants (the tenants' pods run as these).
EXAMPLE_UIDS = {"online": 1000, "batch": 1001}

#: The example policy the ConfigMap ships (edit it in place: the controller applies a change live).
EXAMPLE_POLICY = f"""\
# gpuscope share's policy (docs/share.md): the controller rereads it within half a second of a change
# (a ConfigMap update reaches the pod within the kubelet's sync period, about a minute).
# allow: which processes may join as the tenant. uid/gid rules: a pod's cgroup namespace is its own,
# so the controller sees other pods' cgroups only as relative paths and cgroup: rules do not match.
tenants:
  online:
    share: 0.7
    priority: 1
    memory: 0.5
    allow: ["uid:{EXAMPLE_UIDS['online']}"]
  batch:
    share: 0.3
    memory: 0.4
    allow: ["uid:{EXAMPLE_UIDS['batch']}"]
"""

#: Why the controller holds each privilege it has; the generated DaemonSet carries these as comments.
PRIVILEGES: dict[str, str] = {
    "hostPID: true": "Privilege, host pid namespace: the kernel gives the controller a joining tenant's "
                     "pid (SO_PEERCRED) in the controller's own pid namespace, and NVML lists the GPU's "
                     "processes by host pid; in a pid namespace of its own it could match neither to a "
                     "process.",
    "runtimeClassName: nvidia": "Privilege, NVML: the nvidia runtime mounts the driver's NVML "
                                "(NVIDIA_DRIVER_CAPABILITIES=utility) with every GPU visible and none "
                                "claimed (NVIDIA_VISIBLE_DEVICES=all, no nvidia.com/gpu), as dcgm-exporter "
                                "does.",
    "runAsUser: 0": "Privilege, root (with every capability dropped): the kubelet creates the hostPath "
                    "folder as root's, and the controller keeps its socket and lock only in a folder of "
                    "root or of its own user (no other user may replace them).",
    "hostPath:": "Privilege, a host folder: the join socket, the lock and the copy of the preload library, "
                 "which tenant pods mount read-only at the same path (gpuscope.share.deploy.NODE_DIR).",
}


def _labels(name: str, component: str) -> dict:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": component}


def _hardened(read_only_mounts: list[dict], cpu: tuple[str, str], memory: tuple[str, str]) -> dict:
    """The container fields every gpuscope container has: no capabilities, no privilege escalation,
    a read-only root filesystem (with a tmpfs /tmp, the image's HOME), requests and limits."""
    return {
        "resources": {"requests": {"cpu": cpu[0], "memory": memory[0]},
                      "limits": {"cpu": cpu[1], "memory": memory[1]}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [*read_only_mounts, {"name": "tmp", "mountPath": "/tmp"}],
    }


def _tmp() -> dict:
    return {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}


def _probes(get: dict) -> dict:
    """Readiness and liveness on ``get`` (an httpGet), as the other gpuscope workloads probe."""
    return {"readinessProbe": {"httpGet": dict(get), "periodSeconds": 10, "timeoutSeconds": 5},
            "livenessProbe": {"httpGet": dict(get), "initialDelaySeconds": 10, "periodSeconds": 20,
                              "timeoutSeconds": 5, "failureThreshold": 3}}


def controller_script() -> str:
    """The controller container's shell: tighten the node folder, copy the library (a new file renamed
    over the old one, so tenants that have it mapped keep theirs), then become the controller."""
    lib_dir = deploy.LIBRARY.rsplit("/", 1)[0]
    return "\n".join([
        "set -eu",
        "umask 022",
        f"chmod 0755 {deploy.NODE_DIR}",
        f"mkdir -p {lib_dir}",
        f"chmod 0755 {lib_dir}",
        f'cp "$(python -m gpuscope.share.preload)" {deploy.LIBRARY}.new',
        f"mv -f {deploy.LIBRARY}.new {deploy.LIBRARY}",
        f"exec gpuscope share --share.policy-file {deploy.POLICY_FILE} --share.ledger {deploy.LEDGER} "
        f"--web.listen-address 0.0.0.0:{parts.SHARE_PORT}",
    ]) + "\n"


def policy_configmap(d: Deployment) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(POLICY_CONFIGMAP),
            "data": {deploy.POLICY_KEY: EXAMPLE_POLICY}}


def controller_daemonset(d: Deployment) -> dict:
    labels = _labels(CONTROLLER, "share")
    policy_dir = deploy.POLICY_FILE.rsplit("/", 1)[0]
    container = {
        "name": "share",
        "image": IMAGE,
        "command": ["/bin/sh", "-c", controller_script()],
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": parts.SHARE_PORT}],
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"}],
        # A full core as the limit: hand-overs are due every slice (30 ms), and a CFS quota nearly used up
        # would delay them; the controller itself uses a small fraction of it (docs/share.md).
        **_hardened([{"name": deploy.VOLUME, "mountPath": deploy.NODE_DIR},
                     {"name": "policy", "mountPath": policy_dir, "readOnly": True}],
                    cpu=("50m", "1"), memory=("64Mi", "256Mi")),
        **_probes({"path": "/healthz", "port": METRICS_PORT_NAME}),
    }
    pod = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
        "hostPID": True,
        "runtimeClassName": "nvidia",
        "nodeSelector": {"kubernetes.io/os": "linux", **GPU_NODE_LABEL},
        "tolerations": [dict(GPU_TOLERATION)],
        "securityContext": {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [
            {"name": deploy.VOLUME, "hostPath": {"path": deploy.NODE_DIR, "type": "DirectoryOrCreate"}},
            # The folder, not a subPath: a ConfigMap update swaps the folder's symlink, which the
            # controller notices (a subPath mount would never change).
            {"name": "policy", "configMap": {
                "name": POLICY_CONFIGMAP, "items": [{"key": deploy.POLICY_KEY, "path": deploy.POLICY_KEY}]}},
            _tmp(),
        ],
    }
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta(CONTROLLER, labels),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": CONTROLLER}},
                     "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def controller_service(d: Deployment) -> dict:
    # Headless: Prometheus scrapes each node's controller through the endpoints.
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(CONTROLLER, _labels(CONTROLLER, "share")),
            "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/name": CONTROLLER},
                     "ports": [{"name": METRICS_PORT_NAME, "port": parts.SHARE_PORT,
                                "targetPort": METRICS_PORT_NAME}]}}


def controller_service_monitor(d: Deployment) -> dict:
    interval = duration(d.cluster.scrape_interval_s)
    relabelings = [_job(parts.SHARE.job),
                   {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                    "targetLabel": "host"}]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(CONTROLLER, {**_release(d), "app.kubernetes.io/name": CONTROLLER}),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": CONTROLLER}},
                     "endpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": interval,
                                    "scrapeTimeout": duration(min(10, d.cluster.scrape_interval_s)),
                                    "relabelings": relabelings}]}}


def webhook_deployment(d: Deployment) -> dict:
    labels = _labels(WEBHOOK, "share-webhook")
    container = {
        "name": "webhook",
        "image": IMAGE,
        "args": ["share-webhook", "--web.listen-address", f"0.0.0.0:{deploy.WEBHOOK_PORT}",
                 "--web.tls-cert", f"{TLS_DIR}/tls.crt", "--web.tls-key", f"{TLS_DIR}/tls.key"],
        "ports": [{"name": WEBHOOK_PORT_NAME, "containerPort": deploy.WEBHOOK_PORT}],
        **_hardened([{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}],
                    cpu=("20m", "250m"), memory=("64Mi", "256Mi")),
        **_probes({"path": "/healthz", "port": WEBHOOK_PORT_NAME, "scheme": "HTTPS"}),
    }
    pod = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
        "nodeSelector": {"kubernetes.io/os": "linux"},
        # The two replicas on different nodes where there are two.
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/name": WEBHOOK}}}}]}},
        # fsGroup: the Secret's files are the pod group's, readable by uid 10001 and no one else.
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "tls", "secret": {"secretName": TLS_SECRET, "defaultMode": 0o440}}, _tmp()],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(WEBHOOK, labels),
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app.kubernetes.io/name": WEBHOOK}},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def webhook_service(d: Deployment) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(WEBHOOK, _labels(WEBHOOK, "share-webhook")),
            "spec": {"selector": {"app.kubernetes.io/name": WEBHOOK},
                     "ports": [{"name": WEBHOOK_PORT_NAME, "port": 443, "targetPort": WEBHOOK_PORT_NAME}]}}


def webhook_service_monitor(d: Deployment) -> dict:
    # Its /metrics (reviews by result, connections closed) over the same TLS as the API server's calls:
    # the self-signed certificate is its own CA, and cert-manager puts it in the Secret as ca.crt.
    interval = duration(d.cluster.scrape_interval_s)
    tls = {"ca": {"secret": {"name": TLS_SECRET, "key": "ca.crt"}}, "serverName": webhook_dns_names(d)[0]}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(WEBHOOK, {**_release(d), "app.kubernetes.io/name": WEBHOOK}),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": WEBHOOK}},
                     "endpoints": [{"port": WEBHOOK_PORT_NAME, "path": "/metrics", "scheme": "https",
                                    "tlsConfig": tls, "interval": interval,
                                    "scrapeTimeout": duration(min(10, d.cluster.scrape_interval_s)),
                                    "relabelings": [_job(WEBHOOK)]}]}}


def webhook_pdb(d: Deployment) -> dict:
    # Node drains take one replica at a time: the other keeps answering (a missing webhook admits pods
    # unchanged, so they would start outside their shares).
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(WEBHOOK),
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": WEBHOOK}}}}


def webhook_dns_names(d: Deployment) -> list[str]:
    ns = d.cluster.namespace
    return [f"{WEBHOOK}.{ns}.svc", f"{WEBHOOK}.{ns}.svc.cluster.local"]


def issuer(d: Deployment) -> dict:
    return {"apiVersion": "cert-manager.io/v1", "kind": "Issuer", "metadata": _meta(ISSUER),
            "spec": {"selfSigned": {}}}


def certificate(d: Deployment) -> dict:
    # Self-signed: the certificate is its own CA, which cainjector copies into the webhook configuration
    # (a renewal replaces both; a call in between fails and the pod is admitted unchanged).
    return {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": _meta(CERTIFICATE),
            "spec": {"secretName": TLS_SECRET,
                     "commonName": webhook_dns_names(d)[0],
                     "dnsNames": webhook_dns_names(d),
                     "duration": "8760h",
                     "renewBefore": "720h",
                     "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
                     "usages": ["server auth", "digital signature"],
                     "issuerRef": {"name": ISSUER, "kind": "Issuer", "group": "cert-manager.io"}}}


def mutating_webhook_configuration(d: Deployment) -> dict:
    ns = d.cluster.namespace
    meta = _meta(WEBHOOK_CONFIGURATION, annotations={"cert-manager.io/inject-ca-from": f"{ns}/{CERTIFICATE}"})
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": meta,
            "webhooks": [{
                "name": WEBHOOK_NAME,
                "clientConfig": {"service": {"name": WEBHOOK, "namespace": ns, "path": deploy.WEBHOOK_PATH,
                                             "port": 443}},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pods"], "scope": "Namespaced"}],
                "namespaceSelector": {"matchLabels": {deploy.NAMESPACE_LABEL: deploy.NAMESPACE_LABEL_VALUE}},
                # Fail open: a webhook down or slow must never stop pods from starting.
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": WEBHOOK_TIMEOUT_S,
                "matchPolicy": "Equivalent",
                "reinvocationPolicy": "IfNeeded",
            }]}


def _wrap(text: str, indent: str, width: int = 100) -> str:
    lines, line = [], ""
    for word in re.split(r"\s+", text.strip()):
        if line and len(indent) + 2 + len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    lines.append(line)
    return "".join(f"{indent}# {ln}\n" for ln in lines)


def annotate(text: str, comments: dict[str, str]) -> str:
    """``text`` (YAML) with each comment put before the first line that starts (after its indentation
    and any list dash) with the comment's key, at that line's indentation."""
    lines = text.splitlines(keepends=True)
    for key, comment in comments.items():
        for i, line in enumerate(lines):
            if line.lstrip(" -").startswith(key):
                lines.insert(i, _wrap(comment, " " * (len(line) - len(line.lstrip(" ")))))
                break
        else:
            raise ValueError(f"no line starts with {key!r}")
    return "".join(lines)
