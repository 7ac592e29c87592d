"""Who imports whom inside one of our packages, read from the source (every ``import``, including
those inside functions, so an import added anywhere is seen). The layout tests of the core and of
the engine plugin hold their import directions with it."""

from __future__ import annotations

import ast
import pathlib
from typing import Optional


def module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """For the package at ``root``: each module's name -> the package's modules it imports."""
    return {_module_name(root, p): _imports_of(root, p) for p in root.rglob("*.py")}


def first_circle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """A path of imports that leads back to where it started, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> Optional[list[str]]:
        state[module] = 1
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(root: pathlib.Path, path: pathlib.Path) -> set[str]:
    name = _module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith(root.name):
                continue
            for alias in node.names:  # ``from . import x`` names a module; ``from .x import y`` a name
                candidate = f"{module}.{alias.name}"
                found.add(candidate if _exists(root, candidate) else module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == root.name)
    return {m for m in found if m != name}


def _exists(root: pathlib.Path, module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    # a compiled module counts by its C source (the built .so may be absent)
    return any((root / rel).with_suffix(s).exists() for s in (".py", ".c")) or (root / rel / "__init__.py").exists()
