"""The package's shape: no import circles between its files, no class built from two or more of
the package's own classes (one object cut into mixins), and the coordinators and the transport
hold their parts instead of inheriting them.

Read from the source with `ast`, so a circle is caught even where an import sits inside a
function (which hides it from Python at import time but not from a reader)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "statebridge"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    for path in PACKAGE.rglob("*.c"):  # compiled extensions are modules too
        found[".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)] = path
    return found


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file). `from pkg import name`
    counts as importing `pkg.name` when that is a module, else `pkg`."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, path, node)
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.append(full if full in modules else source)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module and target.startswith("statebridge"):
                    # importing a package runs its __init__, but a module importing its own
                    # package's __init__ names (parent -> child) is not a circle of files.
                    if not module.startswith(target + "."):
                        graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_detector_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circles_between_the_package_files():
    assert circles(import_graph()) == []


def _package_classes():
    for module, path in sorted(_modules().items()):
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                yield module, node


def test_no_class_is_cut_into_package_mixins():
    own = {}
    for module, node in _package_classes():
        own.setdefault(node.name, module)
    offenders = []
    for module, node in _package_classes():
        bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
        package_bases = [b for b in bases if b in own]
        # exceptions aside: an error that is two kinds of error (a ProtocolError that is also a
        # ConfigError) is a classification, not one object cut into pieces.
        if any(b.endswith(("Error", "Exception")) for b in package_bases):
            continue
        if len(package_bases) >= 2:
            offenders.append(f"{module}.{node.name}{tuple(package_bases)}")
    assert offenders == []


def test_the_coordinators_and_the_transport_hold_their_parts():
    for module, name in [
        ("statebridge.connector.decode", "DecodeCoordinator"),
        ("statebridge.connector.prefill", "PrefillServer"),
        ("statebridge.connector.group", "RankGroup"),
        ("statebridge.connector.data.transport", "Transport"),
    ]:
        cls = getattr(importlib.import_module(module), name)
        assert cls.__bases__ == (object,), f"{name} inherits {cls.__bases__}"
