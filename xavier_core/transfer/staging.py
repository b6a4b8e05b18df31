"""Staged NIXL transport: a room's scattered pages cross hosts as a few whole slab chunks.

Why: NIXL pays per descriptor, and a pool that has served traffic hands out scattered pages, so coalesced
runs stay short (runs of ~4 pages read at 1.8 GB/s over NVLink, see DESIGN.md). Instead the source gathers
every page of every KV buffer of a room into a pre-registered staging slab; the reader READs whole chunks
(one descriptor each) into its own slab and scatters each to its pages. This is the path between peers
that cannot use CUDA IPC (other hosts, no peer access), and the fallback of it.

Slab layout: `[num_chunks, chunk_pages, record_bytes]` bytes. A page record is one page of every KV
buffer, in buffer (region) order, buffer b at `offsets[b]`; a chunk is `chunk_pages` records. So a chunk
is one contiguous byte range (one descriptor) and holds whole pages of all layers: it can be scattered on
its own while the next chunk is still on the wire. A room's page i sits in its chunk `i // chunk_pages`,
record `i % chunk_pages`; every chunk is full but the last.

Protocol, with no new request from the decode to the prefill: the prefill knows its decode peer when it
publishes (the Prefill call carries it), so it decides then whether to gather (transport "staged", or
"auto" on a VRAM pool with the reader on another host) and names the chunks in the descriptor's
`staging_runs`, beside the page runs it always publishes. The reader takes the staged path when those
runs are there, the two slabs agree on the chunk size and it has a free chunk itself; otherwise it reads
the page runs as coalesced NIXL descriptors. Running out of slab never fails a request.

Lifetimes (I1): the source takes its chunks before the gather, the gather has finished before the
descriptor leaves, and the chunks come back when the room is unpublished (terminal, and the read ended or
the park timeout passed). The reader's chunks come back once no READ into them is in flight and their
scatter has finished (`staged_read`). `bytes_in_use` counts what is held, so tests see it return to 0.

Copies: per KV buffer one gather and one scatter by index, numpy over DRAM, torch `index_select` /
`index_copy_` on device tensors over VRAM (waited on through a CUDA event). torch is imported only for
VRAM.
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.buffers import KvBuffer
from xavier_core.transfer.errors import InvalidSourceError, LayoutError

I64 = npt.NDArray[np.int64]


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
        record = sum(sizes)
        if region.addr <= 0 or region.bytes_per_page < record or region.bytes_per_page % record:
            raise InvalidSourceError(
                f"endpoint.staging_slab: chunk of {region.bytes_per_page} bytes is not whole "
                f"page records of {record} bytes"
            )
        if region.nbytes < region.bytes_per_page:
            raise InvalidSourceError("endpoint.staging_slab: shorter than one chunk")
        return cls(sizes, region.bytes_per_page // record, region.nbytes // region.bytes_per_page)


def pool_views(buffers: Sequence[KvBuffer]) -> list[Any]:
    """Each KV buffer as a `[pages, bytes_per_page]` uint8 array over its memory, no copy: numpy for
    DRAM, a torch tensor for VRAM."""
    out: list[Any] = []
    for b in buffers:
        if b.device == "cpu":
            raw = (ctypes.c_uint8 * b.nbytes).from_address(b.addr)
            flat: Any = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
        else:
            import torch

            from xavier_core.transfer.cuda_copy import _CudaBytes

            flat = torch.as_tensor(_CudaBytes(b.addr, b.nbytes), device=b.device)
        out.append(flat[: b.num_pages * b.bytes_per_page].reshape(b.num_pages, b.bytes_per_page))
    return out


class Slab:
    """A staging slab of this process: its memory (allocated once, registered with NIXL by the owner),
    its layout and a bounded chunk allocator. Not thread-safe: the port's NIXL thread owns it."""

    def __init__(self, layout: SlabLayout, device: str) -> None:
        self.layout = layout
        self.device = device
        self.memory: Any
        if device == "cpu":
            self.memory = np.empty(layout.nbytes, dtype=np.uint8)
            self._addr = int(self.memory.ctypes.data)
        else:
            import torch

            self.memory = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
            self._addr = int(self.memory.data_ptr())
        self.records: Any = self.memory.reshape(-1, layout.record_bytes)
        self._free = list(range(layout.num_chunks))  # a heap: lowest ids first, so rooms stay compact
        self.fallbacks = 0  # wanted a chunk, found none

    @property
    def buffer(self) -> KvBuffer:
        """The slab as one registered region; a "page" of it is a chunk."""
        return KvBuffer(self._addr, self.layout.nbytes, self.layout.chunk_bytes, self.device)

    @property
    def chunks_in_use(self) -> int:
        return self.layout.num_chunks - len(self._free)

    @property
    def bytes_in_use(self) -> int:
        return self.chunks_in_use * self.layout.chunk_bytes

    def alloc(self, n: int) -> list[int] | None:
        """`n` free chunks (lowest ids first), or None (and a fallback counted) when fewer are free."""
        if n > len(self._free):
            self.fallbacks += 1
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, chunks: Sequence[int]) -> None:
        for c in chunks:
            heapq.heappush(self._free, c)

    def slots(self, chunks: Sequence[int], num_pages: int) -> I64:
        """Record indices of the first `num_pages` records of `chunks`, in order."""
        cp = self.layout.chunk_pages
        all_slots = (np.asarray(chunks, dtype=np.int64)[:, None] * cp + np.arange(cp)).reshape(-1)
        return all_slots[:num_pages]

    def gather(self, pool: Sequence[Any], pages: I64, chunks: Sequence[int]) -> None:
        """Copies `pages` of every pool buffer (`pool_views`) into the records of `chunks`; returns
        once done."""
        self._copy(pool, pages, self.slots(chunks, pages.size), to_slab=True)

    def scatter(self, pool: Sequence[Any], pages: I64, chunk: int) -> None:
        """Copies the first `len(pages)` records of `chunk` to `pages` of every pool buffer; returns
        once done."""
        self._copy(pool, pages, self.slots([chunk], pages.size), to_slab=False)

    def _copy(self, pool: Sequence[Any], pages: I64, slots: I64, to_slab: bool) -> None:
        if len(pool) != len(self.layout.sizes):
            raise LayoutError(f"slab is cut for {len(self.layout.sizes)} buffers, pool has {len(pool)}")
        if pages.size == 0:
            return
        columns = zip(pool, self.layout.offsets, self.layout.sizes, strict=True)
        if self.device == "cpu":
            # numpy fancy indexing: several times faster than torch's index ops on strided CPU views.
            for view, off, size in columns:
                if to_slab:
                    self.records[slots, off : off + size] = view[pages]
                else:
                    view[pages] = self.records[slots, off : off + size]
            return
        import torch

        dev = torch.device(self.device)
        page_idx = torch.from_numpy(pages).to(dev)
        slot_idx = torch.from_numpy(slots).to(dev)
        for t, off, size in columns:
            cols = self.records[:, off : off + size]
            if to_slab:
                cols.index_copy_(0, slot_idx, t.index_select(0, page_idx))
            else:
                t.index_copy_(0, page_idx, cols.index_select(0, slot_idx))
        # The copy is on this thread's current stream; the slab or the pages are handed on only once
        # it has run (I1). An event waits for this stream alone, not the engine's.
        with torch.cuda.device(dev):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            event.synchronize()
