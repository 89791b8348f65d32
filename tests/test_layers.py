"""The package's layers (docs/design.md, "Layout"): imports only go down, and nothing goes in a circle.

Every module under src/gpuscope is parsed (not imported) and each of its gpuscope imports checked:

- a package may import itself and the packages of lower layers, never one of its own layer or above;
- no circle of modules importing each other at import time (``if TYPE_CHECKING:`` imports aside);
- no import of a gpuscope module inside a function, where it would hide an upward import or a circle
  from the reader. The one exception is an import guarded by ``except ImportError``: it defers a module
  that needs an optional third-party dependency (OpenTelemetry, grpcio) until the feature is used.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gpuscope"

#: Lowest first. A package may import packages of lower layers only; "." is the package root (the CLI).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("contract",),                                  # what every part agrees on
    ("util",),                                      # small shared libraries
    ("timing", "logs"),                             # libraries a program embeds: the timer, log shipping
    ("nvml", "server", "share", "receiver"),        # the programs that run beside a model
    ("alerting", "dashboards", "otelcol"),          # generators of rules, dashboards, Collector config
    ("docgen", "kube"),                             # generators that read other generators' output
    ("ops", "diagnose"),                            # operations: stack, fleet, generate, diagnose
    ("loadtest",),                                  # load tests, comparisons, the alert drill
    (".",),                                         # the CLI
)
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str    # the gpuscope module imported (a name imported from a module counts as that module)
    line: int
    in_function: bool
    guarded: bool      # inside ``try`` with an ``except ImportError`` (or ModuleNotFoundError)
    type_checking: bool


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, src: Path = SRC) -> bool:
    """A Python module, a package, or a C extension (its source beside it: built or not)."""
    path = src.joinpath(*name.split("."))
    return (path / "__init__.py").is_file() or any(path.with_suffix(s).is_file() for s in (".py", ".c"))


def package_of(module: str) -> str:
    """``gpuscope.server.api`` → ``server``; a module of the package root → ``.``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package(module)) else "."


def is_package(module: str) -> bool:
    return (SRC.joinpath(*module.split(".")) / "__init__.py").is_file()


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError") for k in kinds)


def imports(path: Path, src: Path = SRC) -> list[Import]:
    """Every gpuscope import of one module, with where it stands."""
    module = module_name(path, src)
    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, guarded: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in _targets(node, package_parts, src):
                found.append(Import(module, target, node.lineno, in_function, guarded, type_checking))
            return
        function = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        if isinstance(node, ast.Try):
            catches = any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, function, guarded or catches, type_checking)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, function, guarded, type_checking)
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, function, guarded, True)
            for child in node.orelse:
                visit(child, function, guarded, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, function, guarded, type_checking)

    visit(ast.parse(path.read_text(), str(path)), False, False, False)
    return found


def _targets(node: ast.Import | ast.ImportFrom, package_parts: list[str], src: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "gpuscope"]
    base = node.module or ""
    if node.level:
        anchor = package_parts[: len(package_parts) - (node.level - 1)]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    if base.split(".")[0] != "gpuscope":
        return []
    # ``from gpuscope.x import y``: the module y where there is one, else x (y is a name in it).
    return [f"{base}.{a.name}" if is_module(f"{base}.{a.name}", src) else base for a in node.names]


def all_imports() -> list[Import]:
    return [i for path in sorted(PACKAGE.rglob("*.py")) for i in imports(path)]


def where(i: Import) -> str:
    return f"{i.importer} (line {i.line}) imports {i.target}"


def test_every_package_has_a_layer():
    packages = {package_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert not packages - set(RANK), f"packages without a layer in LAYERS: {sorted(packages - set(RANK))}"


def test_imports_only_go_down():
    upward = [f"{where(i)}: layer of {package_of(i.target)!r} is not below {package_of(i.importer)!r}"
              for i in all_imports()
              if package_of(i.importer) != package_of(i.target)
              and RANK[package_of(i.target)] >= RANK[package_of(i.importer)]]
    assert not upward, "imports that do not go down a layer:\n" + "\n".join(upward)


def test_no_gpuscope_import_inside_a_function():
    hidden = [where(i) for i in all_imports() if i.in_function and not i.guarded]
    assert not hidden, ("imports of gpuscope modules inside functions (move them to the top; an optional "
                        "dependency's module goes in try/except ImportError):\n" + "\n".join(hidden))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycle_between_modules():
    edges: dict[str, set[str]] = {}
    for i in all_imports():
        if not i.type_checking and not i.in_function and i.target != i.importer:
            edges.setdefault(i.importer, set()).add(i.target)
    found = cycles(edges)
    assert not found, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for i in all_imports():
        a, b = package_of(i.importer), package_of(i.target)
        if a != b and not i.type_checking and not i.in_function:
            edges.setdefault(a, set()).add(b)
    found = cycles(edges)
    assert not found, "packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


# --- the checks themselves fail where they should -----------------------------------------------------


def fake_tree(root: Path, files: dict[str, str]) -> list[Import]:
    """Write a package tree under ``root`` and return its imports, read as the real tree's are."""
    for rel, text in files.items():
        path = root / "gpuscope" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [i for p in sorted((root / "gpuscope").rglob("*.py")) for i in imports(p, root)]


def test_the_checks_see_upward_hidden_and_circular_imports(tmp_path):
    found = fake_tree(tmp_path, {
        "__init__.py": "",
        "contract/__init__.py": "",
        "contract/names.py": "from gpuscope.server import api\n",
        "server/__init__.py": "",
        "server/api.py": ("from typing import TYPE_CHECKING\nfrom . import names_user\n"
                          "if TYPE_CHECKING:\n    from gpuscope.server import late\n"
                          "def f():\n    from gpuscope.contract import names\n"
                          "    try:\n        from .late import x\n    except ImportError:\n        pass\n"),
        "server/names_user.py": "from gpuscope.server.api import f\n",
        "server/late.py": "x = 1\n",
    })
    by = {(i.importer, i.target): i for i in found}
    upward = by[("gpuscope.contract.names", "gpuscope.server.api")]
    assert not upward.in_function and RANK["contract"] < RANK["server"]
    hidden = by[("gpuscope.server.api", "gpuscope.contract.names")]
    assert hidden.in_function and not hidden.guarded
    guarded = [i for i in found if i.target == "gpuscope.server.late" and i.in_function]
    assert guarded and guarded[0].guarded
    typing_only = [i for i in found if i.target == "gpuscope.server.late" and not i.in_function]
    assert typing_only and typing_only[0].type_checking
    edges: dict[str, set[str]] = {}
    for i in found:
        if not i.type_checking and not i.in_function:
            edges.setdefault(i.importer, set()).add(i.target)
    assert ["gpuscope.server.api", "gpuscope.server.names_user"] in cycles(edges)
