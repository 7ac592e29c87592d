"""Run a callback when a module finishes importing (or at once if it already has).

Why: the plugin is loaded in every sglang process (launcher, tokenizer, schedulers, detokenizer,
DP controller) but each process imports a different part of sglang. Patching a module only when
that process imports it keeps, e.g., the HTTP server module out of scheduler processes, and
works whatever the order in which sglang imports things.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from types import ModuleType
from typing import Callable

log = logging.getLogger(__name__)

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.RLock()
_finder: "_PostImportFinder | None" = None


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported; now if it already is."""
    global _finder
    with _lock:
        module = sys.modules.get(module_name)
        if module is not None and not _is_initializing(module):
            _run(callback, module)
            return
        _callbacks.setdefault(module_name, []).append(callback)
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)


def _is_initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _run(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:
        log.exception("weightsync plugin: patching %s failed", module.__name__)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._resolving: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _callbacks or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, fullname)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, inner, fullname: str) -> None:
        self._inner = inner
        self._fullname = fullname

    def __getattr__(self, name):  # get_source, get_code, ... for inspect/linecache
        return getattr(self._inner, name)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        with _lock:
            callbacks = _callbacks.pop(self._fullname, [])
        for callback in callbacks:
            _run(callback, module)
