"""Import-only stand-ins for GPU packages that sglang imports at module load (CPU-test scaffolding).

Role: sglang 0.5.23 imports ``sgl_kernel`` and ``torchvision`` while loading modules that a CPU
server with a text-only Qwen3 never *calls* into (the CPU build of ``sgl_kernel`` is not on PyPI;
PyPI's ``torchvision`` does not match the CPU ``torch`` wheel used here). Putting this directory
on ``PYTHONPATH`` lets those imports succeed.

Invariant: a stand-in never computes anything. Every attribute of a stand-in module is a
``StandIn`` object, and calling one raises ``StandInCalledError`` naming the attribute, so a code
path that really needs the GPU package fails loudly instead of returning wrong numbers.
Submodules named in ``missing`` stay unresolvable (``ImportError``) so sglang's own fallbacks run.
Never install these on a production image: the real packages ship there.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class StandInCalledError(RuntimeError):
    """A CPU-test stand-in was called: the code path needs the real GPU package."""


class StandIn:
    """Placeholder for any attribute; attribute access nests, calling raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> "StandIn":
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise StandInCalledError(
            f"{self._qualname} was called, but it is an import-only CPU-test stand-in from "
            f"tests/cpu_scaffolding; this code path needs the real package (GPU build)."
        )

    def __repr__(self) -> str:
        return f"<CPU-test stand-in {self._qualname}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> StandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates a stand-in module for every submodule of ``root`` except those in ``missing``."""

    def __init__(self, root: str, missing: frozenset[str]) -> None:
        self._root = root
        self._missing = missing

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self._root + "."):
            return None
        if fullname in self._missing:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


def make_standin_package(module: types.ModuleType, missing: tuple[str, ...] = ()) -> None:
    """Turn the package ``module`` (its ``__init__``) into a stand-in: any submodule, any name."""
    module.__class__ = _StandInModule
    sys.meta_path.append(_StandInFinder(module.__name__, frozenset(missing)))
