"""Every sglang entry point that writes the model's parameters is one live apply knows
(``sglang_patch.compat.WEIGHT_WRITERS``; issue 28, point 1).

Read from the installed sglang's source, not imported: every request type the scheduler's
``init_request_dispatcher`` routes, every public method of ``SchedulerWeightUpdaterManager`` and
every action ``WeightChecker.handle`` accepts must be classified in ``compat`` as a writer or as
not writing, with the method we hook present in that release. A release that adds one fails here
until it is classified. Run for both releases: the interpreter's own sglang (0.5.23) and
``.venv-sglang0516``'s (or ``WEIGHTSYNC_SGLANG_PYTHON``'s), located through that interpreter.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_patch import compat

REPO = Path(__file__).resolve().parents[2]


def _sglang_roots() -> dict:
    """{label: sglang package dir} for each release installed here."""
    roots = {}
    pythons = {"interpreter": sys.executable, "0.5.16 venv": str(REPO / ".venv-sglang0516" / "bin" / "python")}
    if os.environ.get("WEIGHTSYNC_SGLANG_PYTHON"):
        pythons["WEIGHTSYNC_SGLANG_PYTHON"] = os.environ["WEIGHTSYNC_SGLANG_PYTHON"]
    for label, python in pythons.items():
        if not os.path.exists(python):
            continue
        # find_spec of a top-level package runs none of its code: fast, and no GPU stand-ins needed
        out = subprocess.run([python, "-c", "import importlib.util as u; s = u.find_spec('sglang'); "
                              "print(s.submodule_search_locations[0] if s else '')"],
                             capture_output=True, text=True, timeout=60)
        root = out.stdout.strip()
        if out.returncode == 0 and root and root not in roots.values():
            roots[label] = root
    return roots


ROOTS = _sglang_roots()


def _release(root: str) -> str:
    """The release installed at ``root`` (its dist-info beside it)."""
    infos = sorted(Path(root).parent.glob("sglang-*.dist-info"))
    return infos[0].name[len("sglang-"):-len(".dist-info")] if infos else "unknown"


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def dispatched_request_types(root: str) -> set:
    """The request types ``Scheduler.init_request_dispatcher`` routes (each tuple's first name)."""
    tree = ast.parse(Path(root, "srt/managers/scheduler.py").read_text())
    fn = _method(_class(tree, "Scheduler"), "init_request_dispatcher")
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Name):
            names.add(node.elts[0].id)
    return names


def dispatched_handlers(root: str) -> dict:
    """{request type: (owner, method)}: ``self.weight_updater.m`` -> manager, ``self.m`` -> scheduler."""
    tree = ast.parse(Path(root, "srt/managers/scheduler.py").read_text())
    fn = _method(_class(tree, "Scheduler"), "init_request_dispatcher")
    out = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Name):
            handler = node.elts[1]
            if isinstance(handler, ast.Attribute):
                base = handler.value
                if isinstance(base, ast.Attribute) and base.attr == "weight_updater":
                    out[node.elts[0].id] = ("manager", handler.attr)
                elif isinstance(base, ast.Name) and base.id == "self":
                    out[node.elts[0].id] = ("scheduler", handler.attr)
    return out


def manager_methods(root: str) -> set:
    tree = ast.parse(Path(root, "srt/managers/scheduler_components/weight_updater.py").read_text())
    cls = _class(tree, "SchedulerWeightUpdaterManager")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def weight_checker_actions(root: str) -> set:
    """The actions ``WeightChecker.handle`` compares ``action`` with."""
    tree = ast.parse(Path(root, "srt/utils/weight_checker.py").read_text())
    fn = _method(_class(tree, "WeightChecker"), "handle")
    actions = set()
    for node in ast.walk(fn):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "action"
                and isinstance(node.comparators[0], ast.Constant)):
            actions.add(node.comparators[0].value)
    return actions


def test_both_sglang_releases_are_found():
    releases = sorted(_release(r) for r in ROOTS.values())
    assert len(ROOTS) >= 1, "no sglang installed"
    if (REPO / ".venv-sglang0516" / "bin" / "python").exists():
        assert releases == ["0.5.16", "0.5.23"], ROOTS  # the scans below then run on both


@pytest.mark.parametrize("label", sorted(ROOTS))
def test_every_request_the_scheduler_dispatches_is_known_to_write_the_weights_or_not(label):
    root = ROOTS[label]
    writers = {w.request for w in compat.WEIGHT_WRITERS}
    assert not writers & set(compat.NOT_WEIGHT_WRITING_REQUESTS)
    unknown = sorted(dispatched_request_types(root) - writers - set(compat.NOT_WEIGHT_WRITING_REQUESTS))
    assert not unknown, (f"sglang {_release(root)} dispatches request types compat.py does not classify: {unknown}; "
                         "read what each handler does and add it to WEIGHT_WRITERS (it writes parameters) or "
                         "NOT_WEIGHT_WRITING_REQUESTS")


@pytest.mark.parametrize("label", sorted(ROOTS))
def test_every_weight_writer_this_release_dispatches_is_hooked_where_it_is_handled(label):
    root = ROOTS[label]
    handlers = dispatched_handlers(root)
    for writer in compat.WEIGHT_WRITERS:
        if writer.request not in handlers:
            assert _release(root) not in writer.releases, (writer, _release(root))  # a writer of another release
            continue
        assert handlers[writer.request] == (writer.owner, writer.method), (
            f"sglang {_release(root)} handles {writer.request} with {handlers[writer.request]}, "
            f"compat says {(writer.owner, writer.method)}: the hook would miss it")


@pytest.mark.parametrize("label", sorted(ROOTS))
def test_every_public_method_of_the_weight_updater_is_known_to_write_the_weights_or_not(label):
    root = ROOTS[label]
    writers = {w.method for w in compat.WEIGHT_WRITERS if w.owner == "manager"}
    unknown = sorted(manager_methods(root) - writers - set(compat.NOT_WEIGHT_WRITING_MANAGER_METHODS))
    assert not unknown, f"sglang {_release(root)}'s SchedulerWeightUpdaterManager has unclassified methods {unknown}"


@pytest.mark.parametrize("label", sorted(ROOTS))
def test_every_weight_checker_action_is_known_to_write_the_weights_or_not(label):
    root = ROOTS[label]
    [checker] = [w for w in compat.WEIGHT_WRITERS if w.request == "CheckWeightsReqInput"]
    actions = weight_checker_actions(root)
    assert "reset_tensors" in actions  # the RL self-check's writing step, on both releases
    unknown = sorted(actions - set(checker.writing_actions) - set(compat.READ_ONLY_WEIGHT_CHECKER_ACTIONS))
    assert not unknown, f"sglang {_release(root)}'s /weights_checker has unclassified actions {unknown}"


def test_a_reset_tensors_call_writes_the_weights_and_a_checksum_does_not():
    from types import SimpleNamespace

    [checker] = [w for w in compat.WEIGHT_WRITERS if w.request == "CheckWeightsReqInput"]
    assert compat.writes_weights(checker, SimpleNamespace(action="reset_tensors"))
    for action in ("snapshot", "compare", "checksum"):
        assert not compat.writes_weights(checker, SimpleNamespace(action=action))
    [tensor] = [w for w in compat.WEIGHT_WRITERS if w.request == "UpdateWeightsFromTensorReqInput"]
    assert compat.writes_weights(tensor, SimpleNamespace())
