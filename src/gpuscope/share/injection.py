"""What the admission webhook does to a pod: the JSON patch that lets it join `gpuscope share`.

A pod annotated ``gpuscope.io/share-tenant: NAME`` gets, in each of its containers, the tenant's
environment (``deploy.tenant_environment``), ``LD_PRELOAD`` naming the preload library (put in front
of a container's own ``LD_PRELOAD``, never instead of it) and a read-only mount of the node's
``gpuscope share`` folder (the join socket and the library, ``deploy.NODE_DIR``), plus that folder as
a hostPath volume. ``gpuscope.io/share-memory`` adds a memory cap each of its processes holds itself
to (it can lower its tenant's cap, never raise it). A pod without the annotation is not changed.

Pure functions, no I/O: ``review_response`` answers an AdmissionReview (``admission.k8s.io/v1``).
The webhook fails open: whatever goes wrong, the pod is allowed (unchanged) and the reason is given
back as a warning and counted.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from gpuscope.share import deploy
from gpuscope.share.policy import check_name, parse_memory

PRELOAD = "LD_PRELOAD"


class InjectionError(ValueError):
    """The pod asks to join but cannot be changed as asked: the message says why."""


@dataclass
class Outcome:
    """``result``: mutated, passed (nothing to do) or error; ``patch``: JSON patch operations."""

    result: str
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _pointer(*parts: object) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _check_tenant(name: object) -> str:
    try:
        return check_name(name)
    except ValueError as exc:
        raise InjectionError(f"{deploy.TENANT_ANNOTATION}: {exc}") from None


def _container_patch(path: list[object], container: dict, env: dict[str, str]) -> list[dict]:
    ops: list[dict] = []
    current = container.get("env")
    if not current:
        ops.append({"op": "add", "path": _pointer(*path, "env"),
                    "value": [{"name": k, "value": v} for k, v in env.items()]})
    else:
        index = {e.get("name"): i for i, e in enumerate(current)}
        for name, value in env.items():
            if name not in index:
                ops.append({"op": "add", "path": _pointer(*path, "env", "-"),
                            "value": {"name": name, "value": value}})
                continue
            own = current[index[name]]
            if name == PRELOAD:
                if "valueFrom" in own:
                    raise InjectionError(f"container {container.get('name')!r} takes {PRELOAD} from "
                                         "valueFrom: the library cannot be put in front of it")
                own_value = own.get("value", "")
                if deploy.LIBRARY in own_value.split():
                    continue  # injected already (a re-admission)
                value = f"{deploy.LIBRARY} {own_value}".strip()
            ops.append({"op": "replace", "path": _pointer(*path, "env", index[name]),
                        "value": {"name": name, "value": value}})
    mounts = container.get("volumeMounts")
    mount = {"name": deploy.VOLUME, "mountPath": deploy.NODE_DIR, "readOnly": True}
    if not mounts:
        ops.append({"op": "add", "path": _pointer(*path, "volumeMounts"), "value": [mount]})
    elif not any(m.get("mountPath") == deploy.NODE_DIR for m in mounts):
        ops.append({"op": "add", "path": _pointer(*path, "volumeMounts", "-"), "value": mount})
    return ops


def pod_patch(pod: dict) -> Outcome:
    """The patch for ``pod`` (an object as the API server sends it)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if deploy.TENANT_ANNOTATION not in annotations:
        return Outcome("passed")
    tenant = _check_tenant(annotations[deploy.TENANT_ANNOTATION])
    memory = annotations.get(deploy.MEMORY_ANNOTATION)
    if memory is not None:
        try:
            parse_memory(memory)
        except ValueError as exc:
            raise InjectionError(f"{deploy.MEMORY_ANNOTATION}: {exc}") from None
    spec = pod.get("spec")
    if not isinstance(spec, dict) or not spec.get("containers"):
        raise InjectionError("the pod has no containers")
    env = {PRELOAD: deploy.LIBRARY, **deploy.tenant_environment(tenant, memory)}
    ops: list[dict] = []
    volume = {"name": deploy.VOLUME, "hostPath": {"path": deploy.NODE_DIR, "type": "Directory"}}
    volumes = spec.get("volumes")
    if not volumes:
        ops.append({"op": "add", "path": "/spec/volumes", "value": [volume]})
    elif not any(v.get("name") == deploy.VOLUME for v in volumes):
        ops.append({"op": "add", "path": "/spec/volumes/-", "value": volume})
    for i, container in enumerate(spec["containers"]):
        ops += _container_patch(["spec", "containers", i], container, env)
    return Outcome("mutated", ops)


def review_response(review: Any) -> tuple[dict, Outcome]:
    """The AdmissionReview answering ``review``, and what was done (for the webhook's counters)."""
    uid = ""
    try:
        if not isinstance(review, dict) or review.get("kind") != "AdmissionReview" or \
                not isinstance(review.get("request"), dict):
            raise InjectionError("not an AdmissionReview with a request")
        request = review["request"]
        uid = str(request.get("uid", ""))
        if not uid:
            raise InjectionError("the request has no uid")
        kind = request.get("kind") or {}
        if kind.get("kind") != "Pod" or request.get("operation") != "CREATE":
            outcome = Outcome("passed")
        else:
            outcome = pod_patch(request.get("object") or {})
    except InjectionError as exc:
        outcome = Outcome("error", warnings=[f"gpuscope share: pod left unchanged: {exc}"])
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if outcome.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(outcome.patch).encode()).decode()
    if outcome.warnings:
        response["warnings"] = outcome.warnings
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}, outcome
