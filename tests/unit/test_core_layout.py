"""The core's layout shows its architecture, and its imports point one way.

``weightsync`` holds the two sides of a weight sync as packages of their own (``publisher``: the
trainer's; ``puller``: the engine host's), both written against the on-disk format (``format``)
and its encodings (``codecs``). The top level keeps the command, the errors and the shared
helpers. Read from the source (every ``import``, including those inside functions).
"""

from __future__ import annotations

import pathlib

import weightsync
from import_graph import first_circle, module_graph, unresolved_imports

ROOT = pathlib.Path(weightsync.__file__).parent
SIDES = ("publisher", "puller")
# what each package may import of ours (packages and top-level modules by name), besides itself
# and the leaves below
MAY_IMPORT = {
    "codecs": set(),
    "format": {"codecs"},
    "publisher": {"format", "codecs", "fsio", "storage"},
    "puller": {"format", "codecs", "fsio", "storage"},
    "storage": {"format", "fsio"},  # where versions live (a dir, a bucket): below both sides
}
LEAVES = ("errors", "knobs", "hooks", "progress")  # progress: the reporter the command installs


def _part_of(module: str) -> str:
    """The package or top-level module of the core that ``module`` is or lies in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "weightsync"


def test_each_feature_of_the_core_has_a_package_and_the_top_level_stays_small():
    for package in ("codecs", "format", *SIDES):
        assert (ROOT / package / "__init__.py").exists(), package
    flat = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert len(flat) <= 12, f"the core's top level has {len(flat)} modules: {flat}; give a feature its package"


def test_the_format_and_codecs_import_neither_side_and_the_sides_not_each_other():
    for module, imports in module_graph(ROOT).items():
        package = _part_of(module)
        if package not in MAY_IMPORT:
            continue
        for imported in imports:
            other = _part_of(imported)
            if other == package or other in LEAVES:
                continue
            assert other in MAY_IMPORT[package], f"{module} imports {imported} ({other}): the core's imports point one way"


def test_the_leaves_import_nothing_of_the_core_but_each_other():
    graph = module_graph(ROOT)
    for leaf in LEAVES:
        outside = {m for m in graph[f"weightsync.{leaf}"] if m.split(".")[-1] not in LEAVES}
        assert not outside, (leaf, outside)


def test_no_module_of_the_core_imports_itself_back_through_a_circle():
    circle = first_circle(module_graph(ROOT))
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_every_import_of_a_core_module_names_something_that_exists():
    assert unresolved_imports(ROOT) == []
