"""The page store's client side: namespaces, page geometry and the async client replicas use.

Names load on first use (PEP 562): an engine that only names a `PageNamespace` loads no gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xavier_core.pagestore.client import ClientSettings, PageStoreClient
    from xavier_core.pagestore.layout import PageGeometry, Span, page_checksum
    from xavier_core.pagestore.namespace import PageNamespace

_MODULES: dict[str, str] = {
    "ClientSettings": "xavier_core.pagestore.client",
    "PageGeometry": "xavier_core.pagestore.layout",
    "PageNamespace": "xavier_core.pagestore.namespace",
    "PageStoreClient": "xavier_core.pagestore.client",
    "Span": "xavier_core.pagestore.layout",
    "page_checksum": "xavier_core.pagestore.layout",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["ClientSettings", "PageGeometry", "PageNamespace", "PageStoreClient", "Span", "page_checksum"]
