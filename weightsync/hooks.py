"""Load a user hook given as a callable or as an import path ``package.module.function``."""

from __future__ import annotations

import importlib
from typing import Callable


def load_callable(spec: "str | Callable | None", *, what: str, error: type[Exception]) -> Callable | None:
    """``spec`` itself when callable (or None), else the object its import path names.

    Raises ``error`` with a message naming ``what`` when the path is malformed or unimportable.
    """
    if spec is None or callable(spec):
        return spec
    module, _, attr = str(spec).rpartition(".")
    if not module:
        raise error(f"{what} {spec!r} is not an import path like 'package.module.function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise error(f"{what} {spec!r} cannot be imported: {e}") from None
