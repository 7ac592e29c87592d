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


def test_the_extras_name_one_install_per_host(wheel):
    """engine host: sglang; plain PyTorch trainer: torch and an HTTP client, no Megatron or Ray;
    Megatron/miles trainer: all of it. The README's install section names these three."""
    from packaging.requirements import Requirement

    meta = _metadata(wheel)
    extras = set(meta.get_all("Provides-Extra"))
    assert {"engine", "torch", "trainer"} <= extras
    needs: dict[str, set[str]] = {extra: set() for extra in extras}
    core: set[str] = set()
    for line in meta.get_all("Requires-Dist"):
        req = Requirement(line)
        named = [e for e in extras if req.marker is not None and req.marker.evaluate({"extra": e})]
        for extra in named:
            needs[extra].add(req.name)
        if req.marker is None:
            core.add(req.name)
    assert needs["torch"] == {"torch", "requests"}
    assert {"torch", "requests", "megatron-core", "ray"} <= needs["trainer"]
    assert "sglang" in needs["engine"]
    assert not core & {"torch", "sglang", "megatron-core", "ray"}  # the core stays light
    readme = (REPO_ROOT / "README.md").read_text()
    for extra in ("engine", "torch", "trainer"):
        assert re.search(rf"pip install [^\n`]*weightsync\[{extra}\]", readme), extra


def test_the_version_the_wheel_declares_is_the_one_weightsync_version_prints(wheel):
    import weightsync

    assert _metadata(wheel)["Version"] == weightsync.__version__


@pytest.fixture(scope="module")
def bare_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) holding the wheel, installed with --no-deps, and the
    core's declared dependencies only, linked from this venv (no network)."""
    from packaging.requirements import Requirement

    root = tmp_path_factory.mktemp("venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    whl = root / Path(wheel.filename).name
    shutil.copy(wheel.filename, whl)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index",
         "-q", str(whl)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    # Only what the wheel declares for the core, taken from here: an undeclared import fails below.
    core = [Requirement(r).name for r in _metadata(wheel).get_all("Requires-Dist") if ";" not in r]
    deps = root / "core-deps"
    deps.mkdir()
    from importlib import metadata

    for name in core:
        dist = metadata.distribution(name)
        for top in (dist.read_text("top_level.txt") or name).split():
            for candidate in (Path(dist.locate_file(top)), Path(dist.locate_file(top + ".libs"))):
                if candidate.exists():
                    (deps / candidate.name).symlink_to(candidate)
            if not (deps / top).exists():
                [module] = [p for p in Path(dist.locate_file("")).glob(top + ".*") if p.suffix in (".py", ".so")] or [None]
                if module is not None:
                    (deps / module.name).symlink_to(module)
    [site] = (venv / "lib").glob("python3*/site-packages")
    (site / "core-deps.pth").write_text(str(deps) + "\n")
    return venv


def test_the_installed_wheel_imports_the_core_and_runs_weightsync_help_without_the_checkout(bare_venv, tmp_path):
    env = {"PATH": f"{bare_venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = subprocess.run(
        [str(bare_venv / "bin" / "python"), "-c",
         "import weightsync, sys; from weightsync import Publisher, pull, RawTensor; "
         "print(weightsync.__file__); print(sorted(m for m in ('torch', 'sglang', 'ray', 'megatron') if m in sys.modules))"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    where, heavy = probe.stdout.splitlines()
    assert str(bare_venv) in where and str(REPO_ROOT) not in where  # the wheel's copy, not the checkout
    assert heavy == "[]"
    helped = subprocess.run([str(bare_venv / "bin" / "weightsync"), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "exit codes:" in helped.stdout and "publish" in helped.stdout
    version = subprocess.run([str(bare_venv / "bin" / "weightsync"), "version"], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert version.stdout.strip() == f"weightsync {_metadata_version(bare_venv)}"


def _metadata_version(venv: Path) -> str:
    [dist_info] = list(venv.glob("lib/python3*/site-packages/weightsync-*.dist-info"))
    return email.message_from_bytes((dist_info / "METADATA").read_bytes())["Version"]


def test_the_readmes_git_url_form_builds_the_same_wheel(wheel, tmp_path):
    """``pip install "weightsync[EXTRA] @ git+URL@COMMIT"``: pip clones the commit and builds it;
    here the URL is this repository's own (file://, no network), at HEAD."""
    if shutil.which("git") is None:
        pytest.skip("no git on this machine")
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    # file://localhost/...: pip reads file:///... in a requirement as a local path
    url = f"weightsync[torch] @ git+file://localhost{REPO_ROOT}@{head.stdout.strip()}"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), url],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    [path] = tmp_path.glob("weightsync-*.whl")
    with zipfile.ZipFile(path) as from_git:
        modules = {n for n in from_git.namelist() if n.endswith(".py")}
        committed = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "ls-tree", "-r", "--name-only", head.stdout.strip(), "weightsync", "sglang_patch",
             "miles_updater"], capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert modules == {n for n in committed if n.endswith(".py")}  # every module of the commit, nothing else
        assert "torch" in _metadata(from_git).get_all("Provides-Extra")
