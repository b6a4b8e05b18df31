"""The page store's client side: namespaces, page geometry and the async client replicas use.

Names load on first use (PEP 562): an engine that only names a `PageNamespace` loads no gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xavier_core._lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _MODULES, globals())

__all__ = ["ClientSettings", "PageGeometry", "PageNamespace", "PageStoreClient", "Span", "page_checksum"]
