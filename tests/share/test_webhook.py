"""The admission webhook: AdmissionReview bodies in the Kubernetes API's shapes, its JSON patch applied
to the pod and the result validated against Kubernetes' own schema, and the HTTPS server."""

from __future__ import annotations

import base64
import copy
import json
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request

import kubernetes_validate
import pytest

from gpuscope.share import deploy
from gpuscope.share.injection import review_response
from gpuscope.share.webhook import WebhookServer, tls_context
from tests.conftest import wait_for

KUBERNETES = kubernetes_validate.utils.latest_version()


def pod(annotations: dict | None = None, **container) -> dict:
    metadata = {"name": "serve", "namespace": "ml", **({"annotations": annotations} if annotations else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
            "spec": {"containers": [{"name": "model", "image": "vllm/vllm-openai:v0.11.0", **container},
                                    {"name": "sidecar", "image": "busybox:1.36"}]}}


def review(obj: object, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002", operation: str = "CREATE") -> dict:
    """An AdmissionReview as the API server sends it: admission.k8s.io/v1, every request field of the
    example in Kubernetes' "Dynamic Admission Control" reference (v1.29 to v1.33 send the same shape)."""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                        "namespace": "ml", "operation": operation,
                        "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                                     "uid": "a1b2", "groups": ["system:serviceaccounts"]},
                        "object": obj, "oldObject": None, "dryRun": False,
                        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}


def apply_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add and replace (what the webhook emits), as the API server applies them."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            if last == "-":
                target.append(op["value"])
            elif op["op"] == "add":
                target.insert(int(last), op["value"])
            else:
                target[int(last)] = op["value"]
        else:
            assert op["op"] == "add" or last in target, op
            target[last] = op["value"]
    return doc


def answered(obj: object, **kw) -> tuple[dict, dict | None]:
    answer, _ = review_response(review(obj, **kw))
    response = answer["response"]
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert response["allowed"] is True  # always: it fails open
    if "patch" not in response:
        return response, None
    assert response["patchType"] == "JSONPatch"
    return response, apply_patch(obj, json.loads(base64.b64decode(response["patch"])))


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_an_annotated_pod_joins_its_tenant_and_stays_a_valid_pod():
    original = pod({deploy.TENANT_ANNOTATION: "online", deploy.MEMORY_ANNOTATION: "24GiB"})
    response, mutated = answered(original)
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    kubernetes_validate.validate(mutated, KUBERNETES, strict=True)
    for container in mutated["spec"]["containers"]:
        assert env_of(container) == {"LD_PRELOAD": deploy.LIBRARY, "GPUSCOPE_SHARE_TENANT": "online",
                                     "GPUSCOPE_SHARE_LEDGER": deploy.LEDGER, "GPUSCOPE_SHARE_MEMORY": "24GiB"}
        assert container["volumeMounts"] == [{"name": deploy.VOLUME, "mountPath": deploy.NODE_DIR,
                                              "readOnly": True}]
    assert mutated["spec"]["volumes"] == [{"name": deploy.VOLUME,
                                           "hostPath": {"path": deploy.NODE_DIR, "type": "Directory"}}]


def test_a_pod_with_its_own_preload_env_and_volumes_keeps_them():
    original = pod({deploy.TENANT_ANNOTATION: "batch"},
                   env=[{"name": "LD_PRELOAD", "value": "/opt/jemalloc.so"},
                        {"name": "HF_HOME", "value": "/cache"}],
                   volumeMounts=[{"name": "cache", "mountPath": "/cache"}])
    original["spec"]["volumes"] = [{"name": "cache", "emptyDir": {}}]
    _, mutated = answered(original)
    kubernetes_validate.validate(mutated, KUBERNETES, strict=True)
    model = mutated["spec"]["containers"][0]
    assert env_of(model)["LD_PRELOAD"] == f"{deploy.LIBRARY} /opt/jemalloc.so"  # in front, not instead
    assert env_of(model)["HF_HOME"] == "/cache" and env_of(model)["GPUSCOPE_SHARE_TENANT"] == "batch"
    assert [m["name"] for m in model["volumeMounts"]] == ["cache", deploy.VOLUME]
    assert [v["name"] for v in mutated["spec"]["volumes"]] == ["cache", deploy.VOLUME]
    _, again = answered(mutated)  # admitted twice (a retried create): nothing doubles
    assert again is None or again == mutated


def test_a_plain_pod_and_other_operations_pass_untouched():
    response, mutated = answered(pod())
    assert mutated is None and "warnings" not in response
    response, mutated = answered(pod({deploy.TENANT_ANNOTATION: "online"}), operation="UPDATE")
    assert mutated is None


@pytest.mark.parametrize(("body", "why"), [
    ({"kind": "AdmissionReview"}, "not an AdmissionReview with a request"),
    (review(pod({deploy.TENANT_ANNOTATION: "on line"})), "letters, digits"),
    (review(pod({deploy.TENANT_ANNOTATION: "online", deploy.MEMORY_ANNOTATION: "lots"})), "share-memory"),
    (review(pod({deploy.TENANT_ANNOTATION: "online"},
                env=[{"name": "LD_PRELOAD", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}])),
     "valueFrom"),
    (review({"metadata": {"annotations": {deploy.TENANT_ANNOTATION: "online"}}}), "no containers"),
    (None, "not an AdmissionReview"),
])
def test_what_it_cannot_do_is_allowed_unchanged_with_a_warning(body, why):
    answer, outcome = review_response(body)
    response = answer["response"]
    assert response["allowed"] is True and "patch" not in response and outcome.result == "error"
    assert why in response["warnings"][0]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt")],
                   check=True, capture_output=True)
    return d / "tls.crt", d / "tls.key"


def test_the_server_answers_reviews_over_https_and_counts_them(certificate):
    cert, key = certificate
    server = WebhookServer(("127.0.0.1", 0), tls_context(str(cert), str(key)), read_timeout=2.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = ssl.create_default_context(cafile=str(cert))

    def post(data: bytes, path: str = deploy.WEBHOOK_PATH) -> tuple[int, dict]:
        request = urllib.request.Request(server.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=client, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        status, answer = post(json.dumps(review(pod({deploy.TENANT_ANNOTATION: "online"}))).encode())
        assert status == 200 and answer["response"]["patchType"] == "JSONPatch"
        status, answer = post(json.dumps(review(pod())).encode())
        assert status == 200 and "patch" not in answer["response"]
        status, answer = post(b"{not json")
        assert status == 200 and answer["response"]["allowed"] is True and answer["response"]["warnings"]
        status, answer = post(b"{}", path="/elsewhere")
        assert status == 404 and "POST /mutate" in answer["error"]
        with urllib.request.urlopen(server.url + "/metrics", context=client, timeout=10) as r:
            metrics = r.read().decode()
        for result in ("mutated", "passed", "error"):
            assert f'gpuscope_share_webhook_reviews_total{{result="{result}"}} 1.0' in metrics
        plain = urllib.request.Request(server.url.replace("https", "http") + "/healthz")
        with pytest.raises(OSError):  # plain HTTP is refused: the handshake fails, the connection closes
            urllib.request.urlopen(plain, timeout=10).read()
        wait_for(lambda: 'reason="timeout"} 1.0' in generate(server), what="the failed handshake counted")
    finally:
        server.shutdown()
        server.server_close()


def generate(server: WebhookServer) -> str:
    from prometheus_client import generate_latest

    return generate_latest(server.registry).decode()
