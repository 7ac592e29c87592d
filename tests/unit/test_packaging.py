"""The wheel ``pip install`` gets: built from a copy of this checkout, then read back.

What it must hold: the three packages (core, engine plugin, trainer side) and the core's
``py.typed``; the sglang plugin entry point and the ``weightsync`` command; no test scaffolding
(no top-level ``testbed`` or ``tests`` in anyone's site-packages). What it declares must match
what the docs tell a GPU box to run (``pip install "weightsync[engine]"``) and what the Docker
image checks.
"""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_DOCS = ("README.md", "docker/README.md")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src") / "weightsync"
    shutil.copytree(
        REPO_ROOT, src,
        ignore=shutil.ignore_patterns(".venv*", ".git", "__pycache__", "build", "dist", "*.egg-info", ".*cache"),
    )  # fmt: skip
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    [path] = out.glob("weightsync-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def _engine_sglang_requirement(wheel: zipfile.ZipFile) -> str:
    """The ``engine`` extra's sglang specifier, e.g. '<0.6,>=0.5.16' (as the wheel spells it)."""
    from packaging.requirements import Requirement

    for line in _metadata(wheel).get_all("Requires-Dist"):
        req = Requirement(line)
        if req.name == "sglang" and req.marker is not None and req.marker.evaluate({"extra": "engine"}):
            return str(req.specifier)
    raise AssertionError("the wheel's engine extra does not require sglang")


def test_the_wheel_holds_the_three_packages_and_no_test_scaffolding(wheel):
    top_level = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"weightsync", "sglang_patch", "miles_updater"}
    assert "weightsync/py.typed" in wheel.namelist()
    assert "sglang_patch/plugin.py" in wheel.namelist()
    [top_txt] = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")] or [None]
    if top_txt:
        assert "testbed" not in wheel.read(top_txt).decode().split()


def test_no_module_in_the_wheel_imports_the_testbed_except_the_repo_only_demo(wheel):
    importers = sorted(
        name for name in wheel.namelist()
        if name.endswith(".py") and re.search(rb"^\s*(from|import) testbed\b", wheel.read(name), re.M)
    )  # fmt: skip
    # The demo runs from a checkout (`make demo`) and says so when the testbed is missing.
    assert importers == ["miles_updater/demo.py"]
    assert b"runs from a checkout" in wheel.read("miles_updater/demo.py")


def test_the_wheel_registers_the_sglang_plugin_and_the_command(wheel):
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(name).decode()
    assert re.search(r"\[sglang\.srt\.plugins\]\s*\npull_weights = sglang_patch\.plugin:load_plugin", text)
    assert re.search(r"\[console_scripts\]\s*\nweightsync = weightsync\.cli:main", text)


def test_the_engine_extra_states_the_tested_sglang_range(wheel):
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_engine_sglang_requirement(wheel))
    tested = ("0.5.16", "0.5.23")  # the Makefile's version matrix
    assert all(v in spec for v in tested), (spec, tested)
    assert "0.5.15" not in spec and "0.6.0" not in spec


def test_the_docs_install_lines_name_extras_the_wheel_declares(wheel):
    from packaging.specifiers import SpecifierSet

    extras = set(_metadata(wheel).get_all("Provides-Extra"))
    spec = SpecifierSet(_engine_sglang_requirement(wheel))
    for doc in INSTALL_DOCS:
        text = (REPO_ROOT / doc).read_text()
        installs = re.findall(r"pip install [^\n`]*?weightsync\[([a-z0-9_,-]+)\]", text)
        assert installs, f"{doc} has no `pip install weightsync[...]` line"
        for group in installs:
            assert set(group.split(",")) <= extras, (doc, group, extras)
        # Where a doc names the sglang range, it is the wheel's.
        for stated in re.findall(r"`sglang(>=[0-9.]+,<[0-9.]+)`", text):
            assert SpecifierSet(stated) == spec, (doc, stated, spec)


def test_the_docker_image_installs_the_engine_extra_and_checks_its_range():
    text = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r'pip install [^\n]*"\.\[engine\]"', text)
    # The image checks its sglang against the range the installed package declares, not a copy.
    assert 'requires("weightsync")' in text and "SpecifierSet" in text
    assert not re.search(r'version\("sglang"\) == "', text)
