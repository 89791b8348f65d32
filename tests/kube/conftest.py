"""Shared helpers for deploy/kubernetes: the rendered objects, the vendored schemas."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import yaml

from gpuscope.kube.render import OVERLAYS, RENDERED

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).resolve().parent / "schemas"


@cache
def rendered(overlay: str) -> tuple[dict, ...]:
    """The objects of ``deploy/kubernetes/rendered/<overlay>.yaml`` (what kubectl apply -k sends)."""
    text = (ROOT / RENDERED / f"{overlay}.yaml").read_text()
    return tuple(doc for doc in yaml.safe_load_all(text) if doc)


def all_rendered() -> list[tuple[str, dict]]:
    return [(overlay, obj) for overlay in OVERLAYS for obj in rendered(overlay)]


def find(overlay: str, kind: str, name: str) -> dict:
    matches = [o for o in rendered(overlay) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{overlay}: {len(matches)} {kind}/{name}"
    return matches[0]


def _strict(node: object) -> None:
    """Reject unknown fields, as the API server's pruning would drop them silently (kubeconform's
    -strict does the same): objects with declared properties get ``additionalProperties: false``.
    Go's regexp takes flags anywhere (``^(?i)...``), Python's only first: such patterns get them moved."""
    if isinstance(node, dict):
        if (node.get("type") == "object" and isinstance(node.get("properties"), dict)
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        pattern = node.get("pattern")
        if isinstance(pattern, str) and pattern.startswith("^(?i)"):
            node["pattern"] = "(?i)^" + pattern.removeprefix("^(?i)")
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) → JSON Schema of each vendored CRD's served versions, made strict."""
    out = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        crd = next(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                _strict(schema)
                out[(f"{group}/{version['name']}", kind)] = schema
    return out


@cache
def adapter_schema() -> dict:
    return json.loads((SCHEMAS / "prometheus-adapter-config.schema.json").read_text())
