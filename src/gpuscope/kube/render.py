"""Render each overlay (the add-ons too) with kustomize into ``deploy/kubernetes/rendered/<overlay>.yaml``:
``python -m gpuscope.kube.render [--check]``.

kustomize (as ``kubectl kustomize``) is the engine; its output is committed so that the offline
validation (tests/kube/) reads exactly what ``kubectl apply -k`` would send, also on a machine
without kubectl. Each rendered file's header records a SHA-256 digest of every input under
``deploy/kubernetes`` (all files but ``rendered/``), so a stale render is caught without kubectl;
with kubectl, ``--check`` also renders again and compares the objects.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

KUBERNETES = Path("deploy/kubernetes")
RENDERED = KUBERNETES / "rendered"
#: Overlays that deploy gpuscope whole.
OVERLAYS = ("gpu", "cpu-demo")
#: Overlays applied beside one of those (``share``: gpuscope share's controller and webhook).
ADDONS = ("share",)
#: Everything rendered.
RENDERS = OVERLAYS + ADDONS
_DIGEST = re.compile(r"^# inputs sha256: ([0-9a-f]{64})$", re.MULTILINE)


def inputs_digest(root: Path) -> str:
    """SHA-256 over every file under deploy/kubernetes except rendered/ (paths and contents)."""
    h = hashlib.sha256()
    base = root / KUBERNETES
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        rel = path.relative_to(base).as_posix()
        if rel.startswith("rendered/"):
            continue
        h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def recorded_digest(text: str) -> str | None:
    match = _DIGEST.search(text)
    return match.group(1) if match else None


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kustomize_version(binary: str) -> str:
    out = subprocess.run([binary, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"Kustomize Version: (\S+)", out)
    return match.group(1) if match else "unknown"


def kustomize(overlay: str, root: Path, binary: str | None = None) -> str:
    """``kubectl kustomize`` of one overlay (raises RuntimeError with kustomize's message)."""
    binary = binary or kubectl()
    if binary is None:
        raise RuntimeError("kubectl not found")
    result = subprocess.run([binary, "kustomize", str(root / KUBERNETES / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay}: {result.stderr.strip()}")
    return result.stdout


def render(overlay: str, root: Path, binary: str | None = None) -> str:
    binary = binary or kubectl()
    body = kustomize(overlay, root, binary)
    return (f"# Rendered by `python -m gpuscope.kube.render`: kubectl kustomize "
            f"deploy/kubernetes/overlays/{overlay} (kustomize {kustomize_version(binary)}). Do not edit.\n"
            f"# inputs sha256: {inputs_digest(root)}\n" + body)


def objects(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuscope.kube.render",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="report stale renders instead of writing (without kubectl: the digest only)")
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="repository root (default: the current directory)")
    args = parser.parse_args(argv)
    binary, digest, stale = kubectl(), inputs_digest(args.root), []
    if binary is None and not args.check:
        print("kubectl not found: it renders the overlays (kubectl kustomize)", file=sys.stderr)
        return 2
    for overlay in RENDERS:
        path = args.root / RENDERED / f"{overlay}.yaml"
        committed = path.read_text() if path.exists() else ""
        if args.check:
            if recorded_digest(committed) != digest:
                stale.append(f"{path.relative_to(args.root)} (inputs changed since it was rendered)")
            elif binary is not None and objects(committed) != objects(kustomize(overlay, args.root, binary)):
                stale.append(f"{path.relative_to(args.root)} (kustomize renders different objects)")
            continue
        text = render(overlay, args.root, binary)
        if text != committed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(args.root)}")
    if stale:
        print("stale (run python -m gpuscope.kube.render): " + ", ".join(stale), file=sys.stderr)
        return 1
    if args.check and binary is None:
        print("kubectl not found: checked the input digests only", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
