"""Arguments of the fused page-copy kernel, prepared with numpy alone (so CPU-only CI covers them).

A KV pool is seen as per-buffer base addresses: buffer b's page p is the `bytes_per_page[b]` bytes at
`bases[b] + p * bytes_per_page[b]`. The kernel addresses every byte as `anchor + offset * elem_bytes`,
where `anchor` is a small tensor of the copying device: its pointer argument lets Triton prove 16-byte
alignment, which it cannot do for addresses loaded from a table, and so emit 16-byte loads and stores.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError, LayoutError
from xavier_core.transfer.common.runs import as_page_array

I64 = npt.NDArray[np.int64]

MAX_BLOCK_BYTES = 16384  # bytes one program copies at most; bigger pages take several programs
MAX_GRID = 2**31 - 1  # CUDA's limit on a grid's x dimension
_VECTOR_BYTES = 16  # the widest load a thread issues (ld.global.v4.b32 / v2.b64)


@dataclass(frozen=True)
class PoolView:
    """One KV pool as device addresses usable on the copying device (local, peer, or IPC-imported)."""

    bases: tuple[int, ...]
    bytes_per_page: tuple[int, ...]
    num_pages: int
    device: int  # the CUDA ordinal whose memory this is, in the process that holds the view
    # Mapped from another process (CUDA IPC): reachable only by kernels on `device`, whose context
    # holds the mapping, and unknown to torch.
    imported: bool = False

    def __post_init__(self) -> None:
        if not self.bases or len(self.bases) != len(self.bytes_per_page):
            raise LayoutError(f"a pool view needs one page size per buffer ({len(self.bases)} buffers)")
        if min(self.bases) <= 0 or min(self.bytes_per_page) <= 0 or self.num_pages < 1:
            raise LayoutError("a pool view needs positive bases, page sizes and page count")

    @classmethod
    def from_buffers(cls, buffers: Sequence[KvBuffer]) -> PoolView:
        """The view of this process's own buffers, which must all sit on one CUDA device."""
        devices = {b.device for b in buffers}
        if len(devices) != 1:
            raise LayoutError(f"KV buffers span devices {sorted(devices)}; a pool view needs one")
        device = devices.pop()
        if not (device.startswith("cuda:") and device[5:].isdigit()):
            raise LayoutError(f"KV buffers on {device!r}: the CUDA copy needs cuda:N buffers")
        return cls(
            bases=tuple(b.addr for b in buffers),
            bytes_per_page=tuple(b.bytes_per_page for b in buffers),
            num_pages=min(b.num_pages for b in buffers),
            device=int(device[5:]),
        )


@dataclass(frozen=True)
class CopyPlan:
    """One kernel launch: buffers sharing a page size, all page pairs. Offsets count `elem_bytes` units."""

    elem_bytes: int  # the element type the kernel moves: 8, 4, 2 or 1 bytes
    align: int  # every page start is a multiple of this many elements (the alignment hint)
    page_elems: int
    block: int  # elements one program copies (a power of two)
    chunks: int  # programs per page per buffer
    src_off: I64  # per buffer: (source base - anchor) / elem_bytes
    dst_off: I64
    src_pages: I64
    dst_pages: I64

    @property
    def even(self) -> bool:
        return self.page_elems % self.block == 0

    @property
    def grid(self) -> int:
        return self.src_pages.size * self.src_off.size * self.chunks

    @property
    def nbytes(self) -> int:
        return self.src_pages.size * self.src_off.size * self.page_elems * self.elem_bytes

    def split(self, max_pages: int) -> list[CopyPlan]:
        """The same copy as launches of at most `max_pages` page pairs each (in order)."""
        n = self.src_pages.size
        if max_pages < 1:
            raise ValueError("max_pages must be at least 1")
        return [
            CopyPlan(
                self.elem_bytes,
                self.align,
                self.page_elems,
                self.block,
                self.chunks,
                self.src_off,
                self.dst_off,
                self.src_pages[i : i + max_pages],
                self.dst_pages[i : i + max_pages],
            )
            for i in range(0, n, max_pages)
        ]


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _widths(values: Sequence[int]) -> tuple[int, int]:
    """(element bytes, alignment in elements) that every value in `values` is a multiple of."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    low = g & -g if g else _VECTOR_BYTES
    elem = min(8, low)
    return elem, max(1, min(_VECTOR_BYTES, low) // elem)


def check_pages(src: PoolView, dst: PoolView, src_pages: object, dst_pages: object) -> tuple[I64, I64]:
    """Validated page arrays: equal lengths, in range on each side, no destination page twice."""
    s = as_page_array(src_pages)  # type: ignore[arg-type]
    d = as_page_array(dst_pages)  # type: ignore[arg-type]
    if s.size != d.size:
        raise InvalidPagesError(f"page count mismatch: source has {s.size} pages, destination {d.size}")
    if s.size and int(s.max()) >= src.num_pages:
        raise InvalidPagesError(f"source page {int(s.max())} is outside the pool ({src.num_pages} pages)")
    if d.size and int(d.max()) >= dst.num_pages:
        raise InvalidPagesError(
            f"destination page {int(d.max())} is outside the pool ({dst.num_pages} pages)"
        )
    ordered = np.sort(d)
    if ordered.size > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        # Two programs would write one page in an unspecified order.
        raise InvalidPagesError("a destination page appears twice")
    return s, d


def check_layout(src: PoolView, dst: PoolView) -> None:
    """The two pools line up buffer for buffer (same count, same bytes per page)."""
    if len(src.bases) != len(dst.bases):
        raise LayoutError(f"buffer count mismatch: source {len(src.bases)}, destination {len(dst.bases)}")
    if src.bytes_per_page != dst.bytes_per_page:
        raise LayoutError("bytes per page differ between source and destination buffers")


@functools.lru_cache(maxsize=64)
def _launch_layouts(src: PoolView, dst: PoolView, anchor: int) -> tuple[CopyPlan, ...]:
    """Per page size, everything but the pages; computed once per pair of pools (views are frozen)."""
    check_layout(src, dst)
    if anchor <= 0 or anchor % _VECTOR_BYTES:
        raise LayoutError(f"the anchor address must be positive and {_VECTOR_BYTES}-byte aligned")
    none = np.zeros(0, dtype=np.int64)
    out = []
    for bpp in sorted(set(src.bytes_per_page)):
        idx = [i for i, b in enumerate(src.bytes_per_page) if b == bpp]
        src_bases = [src.bases[i] for i in idx]
        dst_bases = [dst.bases[i] for i in idx]
        elem, align = _widths([bpp, *src_bases, *dst_bases])
        page_elems = bpp // elem
        block = min(1 << (page_elems - 1).bit_length(), _pow2_floor(MAX_BLOCK_BYTES // elem))
        out.append(
            CopyPlan(
                elem_bytes=elem,
                align=align,
                page_elems=page_elems,
                block=block,
                chunks=-(-page_elems // block),
                src_off=np.array([(b - anchor) // elem for b in src_bases], dtype=np.int64),
                dst_off=np.array([(b - anchor) // elem for b in dst_bases], dtype=np.int64),
                src_pages=none,
                dst_pages=none,
            )
        )
    return tuple(out)


def plan_copy(
    src: PoolView, dst: PoolView, src_pages: object, dst_pages: object, anchor: int
) -> list[CopyPlan]:
    """Launch arguments copying `src_pages[i]` to `dst_pages[i]` in every buffer; one plan per page size."""
    layouts = _launch_layouts(src, dst, anchor)
    s, d = check_pages(src, dst, src_pages, dst_pages)
    if s.size == 0:
        return []
    plans = []
    for layout in layouts:
        plan = dataclasses.replace(layout, src_pages=s, dst_pages=d)
        per_launch = max(1, MAX_GRID // (layout.src_off.size * layout.chunks))
        plans.extend(plan.split(per_launch) if s.size > per_launch else [plan])
    return plans
