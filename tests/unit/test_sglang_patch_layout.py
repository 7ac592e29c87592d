"""The engine plugin's layout shows its architecture, and its imports point one way.

``sglang_patch``'s top-level modules are the sglang glue; ``pull`` and ``live`` are the two
features; ``paths`` and ``compat`` are leaves that any part may use. Read from the source (every
``import``, including those inside functions), so an import added anywhere is seen.
"""

from __future__ import annotations

import pathlib

import sglang_patch
from import_graph import first_circle, module_graph, unresolved_imports

ROOT = pathlib.Path(sglang_patch.__file__).parent
FEATURES = ("pull", "live")
LEAVES = ("paths", "compat")


def _graph() -> dict[str, set[str]]:
    return module_graph(ROOT)


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
    circle = first_circle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


LIVE_LAYERS = {  # what each of live apply's inner packages may import of the live package
    "mapping": {"mapping", "loop_slices"},
    "scatter": {"scatter", "mapping", "loop_slices"},
}


def test_live_apply_s_mapping_and_scatter_import_nothing_of_the_transaction_check_or_state_above_them():
    for module, imports in _graph().items():
        parts = module.split(".")
        if parts[:2] != ["sglang_patch", "live"] or len(parts) < 4 or parts[2] not in LIVE_LAYERS:
            continue
        for imported in imports:
            ip = imported.split(".")
            if ip[:2] != ["sglang_patch", "live"] or len(ip) < 3:
                continue
            assert ip[2] in LIVE_LAYERS[parts[2]], f"{module} imports {imported}: live's inner packages point one way"


def test_every_import_of_a_plugin_module_names_something_that_exists():
    # read from the source: the scheduler's and tokenizer's hooks import only inside a server
    assert unresolved_imports(ROOT) == []
