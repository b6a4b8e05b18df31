"""Page store namespaces, apart from the client so engines can name one without loading gRPC."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageNamespace:
    """Where pages live: KV contract fingerprint + tenant salt (+ rank). Never shared across (I5)."""

    contract_fingerprint: str
    cache_salt: str = ""
    rank: int = 0
