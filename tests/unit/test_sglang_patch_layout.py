"""The engine plugin's layout shows its architecture, and its imports point one way.

``sglang_patch``'s top-level modules are the sglang glue; ``pull`` and ``live`` are the two
features; ``paths`` and ``compat`` are leaves that any part may use. Read from the source (every
``import``, including those inside functions), so an import added anywhere is seen.
"""

from __future__ import annotations

import ast
import pathlib

import sglang_patch

ROOT = pathlib.Path(sglang_patch.__file__).parent
FEATURES = ("pull", "live")
LEAVES = ("paths", "compat")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: pathlib.Path) -> set[str]:
    """Every sglang_patch module ``path`` imports (relative or absolute, at any depth)."""
    name = _module_name(path)
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
            if not module.startswith("sglang_patch"):
                continue
            for alias in node.names:  # ``from . import x`` names a module; ``from .x import y`` a name
                candidate = f"{module}.{alias.name}"
                found.add(candidate if _exists(candidate) else module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("sglang_patch"))
    return {m for m in found if m != name}


def _exists(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    # a compiled module counts by its C source (the built .so may be absent)
    return any((ROOT / rel).with_suffix(s).exists() for s in (".py", ".c")) or (ROOT / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports_of(p) for p in ROOT.rglob("*.py")}


def _feature_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in FEATURES else "glue"


def test_the_two_features_have_packages_of_their_own():
    for feature in FEATURES:
        assert (ROOT / feature / "__init__.py").exists()
    flat = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert not [m for m in flat if m.startswith(("live_", "pull_")) and m != "live_hooks"], flat


def test_the_feature_packages_import_no_glue_only_the_leaves():
    for module, imports in _graph().items():
        if _feature_of(module) == "glue":
            continue
        glue = sorted(m for m in imports if _feature_of(m) == "glue" and m.split(".")[1] not in LEAVES)
        assert not glue, f"{module} imports the sglang glue {glue}: pass what it needs in instead"


def test_live_apply_never_imports_the_pull_and_the_leaves_import_nothing_of_ours():
    graph = _graph()
    for module, imports in graph.items():
        if _feature_of(module) == "live":
            assert not [m for m in imports if _feature_of(m) == "pull"], (module, imports)
    for leaf in LEAVES:
        assert not graph[f"sglang_patch.{leaf}"], (leaf, graph[f"sglang_patch.{leaf}"])


def test_no_module_of_the_plugin_imports_itself_back_through_a_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
