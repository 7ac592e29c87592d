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
            module = _imported_module(node, package)
            if not module.startswith(root.name):
                continue
            for alias in node.names:  # ``from . import x`` names a module; ``from .x import y`` a name
                candidate = f"{module}.{alias.name}"
                found.add(candidate if _exists(root, candidate) else module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == root.name)
    return {m for m in found if m != name}


def _imported_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module ``node`` imports from, seen from ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _exists(root: pathlib.Path, module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    # a compiled module counts by its C source (the built .so may be absent)
    return any((root / rel).with_suffix(s).exists() for s in (".py", ".c")) or (root / rel / "__init__.py").exists()


def unresolved_imports(root: pathlib.Path) -> list[str]:
    """Every ``from <ours> import name`` in the package at ``root`` whose module does not exist or
    neither has a submodule nor defines ``name`` at its top level: what a moved module leaves
    behind in a file no test imports (a scheduler-side hook, say)."""
    found = []
    for path in root.rglob("*.py"):
        name = _module_name(root, path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = _imported_module(node, package)
            if module.split(".")[0] != root.name:
                continue
            source = _source_of(root, module)
            if source is None:
                found.append(f"{name}:{node.lineno}: no module {module}")
                continue
            defined = _top_level_names(source)
            for alias in node.names:
                if alias.name != "*" and alias.name not in defined and not _exists(root, f"{module}.{alias.name}"):
                    found.append(f"{name}:{node.lineno}: {module} has no {alias.name}")
    return found


def _source_of(root: pathlib.Path, module: str) -> Optional[pathlib.Path]:
    rel = pathlib.Path(*module.split(".")[1:])
    for candidate in ((root / rel).with_suffix(".py"), root / rel / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _top_level_names(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # definitions under a guard count
            for field in ("body", "orelse", "finalbody", "handlers"):
                pending.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            pending.extend(node.body)
    return names
