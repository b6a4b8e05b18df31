"""The page store's client side: namespaces, page geometry and the async client replicas use."""

from xavier_core.pagestore.client import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore.layout import PageGeometry, Span, page_checksum

__all__ = ["ClientSettings", "PageGeometry", "PageNamespace", "PageStoreClient", "Span", "page_checksum"]
