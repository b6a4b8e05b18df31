"""Lazy package exports (PEP 562): a package names what it exports and from which module, and a name's
module is imported on first use, so importing one light module of a package loads none of the heavy ones."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, modules: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's module-level `__getattr__`: `modules` maps each exported name to its module."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups are plain attribute reads
        return value

    return __getattr__
