"""Staged NIXL transport: a room's scattered pages cross hosts as a few whole slab chunks.

Why: NIXL pays per descriptor, and a pool that has served traffic hands out scattered pages, so coalesced
runs stay short (runs of ~4 pages read at 1.8 GB/s over NVLink, see DESIGN.md). Instead the source gathers
every page of every KV buffer of a room into a pre-registered staging slab; the reader READs whole chunks
(one descriptor each) into its own slab and scatters each to its pages. This is the path between peers
that cannot use CUDA IPC (other hosts, no peer access), and the fallback of it.

Slab layout: `num_chunks` chunks of `chunk_pages` page records; a page record is one page of every KV
buffer. A room's page i sits in its chunk `i // chunk_pages`; every chunk is full but the last. The n
pages a chunk holds are packed from its start, buffer-major: buffer b's n pages sit together at
`n * offsets[b]`. So what a chunk holds is one contiguous range of `n * record_bytes` (one descriptor,
one READ), holds whole pages of all layers (it can be scattered on its own while the next chunk is still
on the wire), and is, to the fused page-copy kernel of `cuda.copy`, just a pool of n pages per buffer.

Protocol, with no new request from the decode to the prefill: the prefill knows its decode peer when it
publishes (the Prefill call carries it), so it decides then whether to gather (transport "staged", or
"auto" on a VRAM pool with the reader on another host) and names the chunks in the descriptor's
`staging_runs`, beside the page runs it always publishes. The reader takes the staged path when those
runs are there, the two slabs agree on the chunk size and it has a free chunk itself; otherwise it reads
the page runs as coalesced NIXL descriptors. Running out of slab never fails a request.

Lifetimes (I1): the source takes its chunks before the gather, the gather has finished before the
descriptor leaves, and the chunks come back when the room is unpublished (terminal, and the read ended or
the park timeout passed). The reader's chunks come back once no READ into them is in flight and their
scatter has finished (`staged.read`). `bytes_in_use` counts what is held, so tests see it return to 0.

Copies: one gather per chunk on the source, one scatter per chunk on the reader, both as page copies
between two pool views (bases, bytes per page): the fused Triton kernel of `cuda.copy` on VRAM (one
launch per chunk, all buffers; a `CopyHandle` whose CUDA event says when it is done), numpy by index
over DRAM (done on return). The same view arithmetic runs on both, so CPU CI checks the GPU's addresses.
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError, LayoutError
from xavier_core.transfer.common.slab_layout import SlabLayout

if TYPE_CHECKING:
    from xavier_core.transfer.cuda.copy import CopyHandle

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class View:
    """Pages of several buffers: buffer b's page p is `sizes[b]` bytes at `bases[b] + p * sizes[b]`."""

    bases: tuple[int, ...]
    sizes: tuple[int, ...]
    num_pages: int

    @classmethod
    def of(cls, buffers: Sequence[KvBuffer]) -> View:
        return cls(
            tuple(b.addr for b in buffers),
            tuple(b.bytes_per_page for b in buffers),
            min(b.num_pages for b in buffers),
        )


def _host_pages(view: View, b: int) -> npt.NDArray[np.uint8]:
    """Buffer b of a DRAM view as a `[pages, size]` array over its memory (no copy)."""
    size = view.sizes[b]
    raw = (ctypes.c_uint8 * (view.num_pages * size)).from_address(view.bases[b])
    return np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8).reshape(view.num_pages, size)


def _host_copy(src: View, dst: View, src_pages: I64, dst_pages: I64) -> None:
    """DRAM page copy by index; a side that is a chunk's leading pages is a plain slice (no temporary)."""
    n = src_pages.size
    for pages, view in ((src_pages, src), (dst_pages, dst)):
        if n and (int(pages.min()) < 0 or int(pages.max()) >= view.num_pages):
            raise InvalidPagesError(f"page {int(pages.max())} is outside a view of {view.num_pages} pages")
    leading = np.arange(n, dtype=np.int64)
    for b in range(len(src.sizes)):
        s, d = _host_pages(src, b), _host_pages(dst, b)
        if np.array_equal(dst_pages, leading):
            np.take(s, src_pages, axis=0, out=d[:n], mode="clip")  # in range: checked above
        elif np.array_equal(src_pages, leading):
            d[dst_pages] = s[:n]
        else:
            d[dst_pages] = s[src_pages]


def copy_view_pages(src: View, dst: View, src_pages: I64, dst_pages: I64, device: str) -> CopyHandle | None:
    """Copies page `src_pages[i]` of `src` to page `dst_pages[i]` of `dst`, in every buffer. DRAM: done
    on return (None). VRAM: issued as one fused launch on the device's copy stream, after the work
    already queued on its current stream; the handle says when it is done."""
    if src.sizes != dst.sizes:
        raise LayoutError("the two views' buffers differ in bytes per page")
    if device == "cpu":
        _host_copy(src, dst, src_pages, dst_pages)
        return None
    from xavier_core.transfer.cuda.copy import copy_pages
    from xavier_core.transfer.cuda.copy_plan import PoolView

    ordinal = int(device.partition(":")[2] or 0)
    views = [PoolView(v.bases, v.sizes, v.num_pages, ordinal) for v in (src, dst)]
    return copy_pages(views[0], views[1], src_pages, dst_pages, device=ordinal)


class Slab:
    """A staging slab of this process: its memory (allocated once, registered with NIXL by the owner),
    its layout and a bounded chunk allocator. Not thread-safe: the port's NIXL thread owns it."""

    def __init__(self, layout: SlabLayout, device: str) -> None:
        self.layout = layout
        self.device = device
        self.memory: Any  # held for the slab's life: NIXL and the copies use its address
        if device == "cpu":
            self.memory = np.zeros(layout.nbytes, dtype=np.uint8)
            self._addr = int(self.memory.ctypes.data)
        else:
            import torch

            self.memory = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
            self._addr = int(self.memory.data_ptr())
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

    def chunk(self, chunk: int, pages: int) -> View:
        """The first `pages` page records of a chunk as a view: packed into `pages * record_bytes`
        bytes from the chunk's start (a room's last chunk is short), buffer-major."""
        lay = self.layout
        if not 0 < pages <= lay.chunk_pages or not 0 <= chunk < lay.num_chunks:
            raise LayoutError(f"chunk {chunk} of {lay.num_chunks} has no {pages} pages")
        start = self._addr + chunk * lay.chunk_bytes
        return View(tuple(start + pages * off for off in lay.offsets), lay.sizes, pages)

    def gather(self, pool: View, pages: I64, chunks: Sequence[int]) -> None:
        """Copies `pages` of every pool buffer into `chunks` (in order); returns once done."""
        cp = self.layout.chunk_pages
        last = None
        for i, c in enumerate(chunks):
            part = pages[i * cp : (i + 1) * cp]
            local = np.arange(part.size, dtype=np.int64)
            last = copy_view_pages(pool, self.chunk(c, part.size), part, local, self.device) or last
        if last is not None:
            last.wait()  # one stream: the last launch ends after the others (I1: done before publish)

    def scatter(self, pool: View, pages: I64, chunk: int) -> CopyHandle | None:
        """Copies the first `len(pages)` pages of `chunk` to `pages` of every pool buffer: done on
        return on DRAM, else when the handle says so."""
        local = np.arange(pages.size, dtype=np.int64)
        return copy_view_pages(self.chunk(chunk, pages.size), pool, local, pages, self.device)
