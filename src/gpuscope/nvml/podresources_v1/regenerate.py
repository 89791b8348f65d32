"""Regenerate ``api_pb2.py`` and ``api_pb2_grpc.py`` from ``api.proto``: ``python -m
gpuscope.nvml.podresources_v1.regenerate [--check]``.

Runs ``grpc_tools.protoc`` (``pip install grpcio-tools``, the version pinned in pyproject.toml's
``dev`` extra: the stubs name the versions that made them) with ``src/`` as the import root, so
the stubs import each other as ``gpuscope.nvml.podresources_v1``. Each generated file gets a header
naming this command and turning ruff off (generated code is not held to the project's style).
``--check`` writes nothing and exits 1 if a committed stub differs from what would be generated.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMPORT_ROOT = HERE.parents[2]  # src/
PROTO = HERE / "api.proto"
STUBS = ("api_pb2.py", "api_pb2_grpc.py")
HEADER = ("# ruff: noqa\n"
          "# Generated from api.proto by `python -m gpuscope.nvml.podresources_v1.regenerate`;\n"
          "# do not edit.\n")


def generate() -> dict[str, str]:
    """File name → content of each stub, generated now from ``api.proto``."""
    from grpc_tools import protoc  # a dev dependency: only regeneration needs it

    rel = PROTO.relative_to(IMPORT_ROOT).as_posix()
    with tempfile.TemporaryDirectory() as out:
        include = Path(protoc.__file__).parent / "_proto"  # protoc's well-known types
        code = protoc.main(["grpc_tools.protoc", f"-I{IMPORT_ROOT}", f"-I{include}",
                            f"--python_out={out}", f"--grpc_python_out={out}", rel])
        if code != 0:
            raise RuntimeError(f"protoc failed with status {code}")
        generated = Path(out) / Path(rel).parent
        return {name: HEADER + (generated / name).read_text() for name in STUBS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuscope.nvml.podresources_v1.regenerate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale stubs instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, content in generate().items():
        path = HERE / name
        if path.exists() and path.read_text() == content:
            continue
        if args.check:
            stale.append(name)
            continue
        path.write_text(content)
        print(f"wrote {path.relative_to(IMPORT_ROOT.parent)}")
    if stale:
        print("stale (run python -m gpuscope.nvml.podresources_v1.regenerate): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
