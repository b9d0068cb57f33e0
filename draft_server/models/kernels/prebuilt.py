"""Compiled extensions built earlier (carried to the machine, or installed) instead of a fresh build.

Owns the one lookup both JIT-built extensions (FlashMLA's binding, exllamav3's kernels) make before
building: a top-level extension module of their name already importable from ``sys.path``. A Python
module of that name is not one (never imported here).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
from types import ModuleType


def find_extension(name: str) -> ModuleType | None:
    """The compiled module ``name`` if one is importable as a top-level extension, else None; an
    extension that fails to import (built against another torch) raises its ImportError."""
    spec = importlib.util.find_spec(name)
    if spec is None or not (spec.origin or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        return None
    return importlib.import_module(name)
