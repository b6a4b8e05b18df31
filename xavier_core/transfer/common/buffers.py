"""What the transfer layer knows of a KV pool: registered buffers, each cut into equal pages."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvBuffer:
    """One registered KV buffer (e.g. a layer's K or V): page p is bytes
    [addr + p * bytes_per_page, addr + (p + 1) * bytes_per_page). Nothing else about its owner is known."""

    addr: int
    nbytes: int
    bytes_per_page: int
    device: str  # "cpu", "cuda" or "cuda:N"

    @property
    def num_pages(self) -> int:
        return self.nbytes // self.bytes_per_page
