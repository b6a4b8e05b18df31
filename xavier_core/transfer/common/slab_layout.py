"""How a staging slab is cut (`SlabLayout`): the one fact of the staged transport that a source's descriptor
carries, so it sits with the shared types; the slab itself and its copies are `staged.slab`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidSourceError, LayoutError


@dataclass(frozen=True)
class SlabLayout:
    """How a slab is cut: page records of `sizes` (bytes per page of each KV buffer), chunks of
    `chunk_pages` records, `num_chunks` chunks."""

    sizes: tuple[int, ...]
    chunk_pages: int
    num_chunks: int

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1 or self.chunk_pages < 1 or self.num_chunks < 1:
            raise LayoutError(f"invalid staging slab layout {self}")

    @property
    def record_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0, *self.sizes[:-1])))

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_pages * self.record_bytes

    @property
    def nbytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    def chunks_for(self, num_pages: int) -> int:
        return -(-num_pages // self.chunk_pages)

    @classmethod
    def plan(cls, buffers: Sequence[KvBuffer], chunk_bytes: int, slab_bytes: int) -> SlabLayout:
        """A slab for `buffers`: chunks of whole records (at least one) within `chunk_bytes`, as many
        as fit in `slab_bytes` (at least one)."""
        sizes = tuple(b.bytes_per_page for b in buffers)
        record = sum(sizes)
        pages = max(1, chunk_bytes // record)
        return cls(sizes, pages, max(1, slab_bytes // (pages * record)))

    @classmethod
    def of_peer(cls, buffers: Sequence[KvBuffer], region: KvBuffer) -> SlabLayout:
        """A peer's slab from its endpoint: its KV buffers and its `staging_slab` region (whose
        bytes_per_page is the chunk size). `InvalidSourceError` when the two do not fit together."""
        sizes = tuple(b.bytes_per_page for b in buffers)
        if not sizes or min(sizes) < 1:
            raise InvalidSourceError("endpoint.regions: a KV buffer without bytes per page")
        record = sum(sizes)
        if region.addr <= 0 or region.bytes_per_page < record or region.bytes_per_page % record:
            raise InvalidSourceError(
                f"endpoint.staging_slab: chunk of {region.bytes_per_page} bytes is not whole "
                f"page records of {record} bytes"
            )
        if region.nbytes < region.bytes_per_page:
            raise InvalidSourceError("endpoint.staging_slab: shorter than one chunk")
        return cls(sizes, region.bytes_per_page // record, region.nbytes // region.bytes_per_page)
