"""Page runs and their pairing into transfer descriptors.

A descriptor copies one stretch of pages that is contiguous on BOTH sides, for one buffer. Everything is
vectorised with numpy: the coalesced path has no Python loop per page, so 8k-page lists cost microseconds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common.errors import InvalidPagesError, LayoutError

Mode = Literal["coalesced", "per_page"]
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PageRun:
    """`count` consecutive pages starting at page `first`."""

    first: int
    count: int

    def __post_init__(self) -> None:
        if self.first < 0 or self.count < 1:
            raise InvalidPagesError(f"invalid page run (first={self.first}, count={self.count})")


def as_page_array(page_ids: Sequence[int] | npt.NDArray[np.integer]) -> I64:
    """Validates page ids (1-D, non-negative integers) and returns them as an int64 array."""
    arr = np.asarray(page_ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidPagesError("page ids must be a flat list of integers")
    out = arr.astype(np.int64, copy=False)
    if int(out.min()) < 0:
        raise InvalidPagesError("page ids must be non-negative")
    return out


SMALL = 64
"""Up to this many pages, runs and stretches are found in plain Python over lists: a pull or a publication
of a few pages then costs a few microseconds, where each numpy call on a tiny array costs one or two
(15-35 µs for one of the functions below, per call, several times per request)."""


def _small_breaks(arrays: Sequence[list[int]], n: int) -> list[int]:
    """`_breaks` over lists (short ones)."""
    if len(arrays) == 1:
        (a,) = arrays
        return [0, *(i for i in range(1, n) if a[i] != a[i - 1] + 1)]
    a, b = arrays
    return [0, *(i for i in range(1, n) if a[i] != a[i - 1] + 1 or b[i] != b[i - 1] + 1)]


def _small_stretches(arrays: Sequence[list[int]], n: int) -> list[tuple[int, int]]:
    """(start position, length) of each maximal stretch of `_small_breaks`."""
    starts = _small_breaks(arrays, n)
    return list(zip(starts, [b - a for a, b in itertools.pairwise([*starts, n])], strict=True))


def _breaks(*arrays: I64) -> I64:
    """Start positions of maximal stretches where every array steps by exactly +1."""
    n = arrays[0].size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if n <= SMALL and len(arrays) <= 2:
        return np.array(_small_breaks([a.tolist() for a in arrays], n), dtype=np.int64)
    step = np.ones(n - 1, dtype=bool)
    for a in arrays:
        step &= np.diff(a) == 1
    return np.concatenate(([0], np.flatnonzero(~step) + 1)).astype(np.int64)


def coalesce(page_ids: Sequence[int] | npt.NDArray[np.integer]) -> list[PageRun]:
    """Groups page ids into runs of consecutive ids, keeping their order (no sorting)."""
    ids = as_page_array(page_ids)
    if 0 < ids.size <= SMALL:
        listed = ids.tolist()
        return [PageRun(listed[i], count) for i, count in _small_stretches([listed], len(listed))]
    starts = _breaks(ids)
    counts = np.diff(np.append(starts, ids.size))
    return [PageRun(int(f), int(c)) for f, c in zip(ids[starts], counts, strict=True)]


def expand(runs: Iterable[PageRun]) -> list[int]:
    """The page ids the runs cover, in order."""
    return [int(p) for p in runs_to_pages(runs)]


def runs_to_pages(runs: Iterable[PageRun]) -> I64:
    """Like `expand` but returns an int64 array (vectorised)."""
    run_list = list(runs)
    if not run_list:
        return np.zeros(0, dtype=np.int64)
    if len(run_list) == 1:  # the common case of a fresh pool: no repeat and cumsum needed
        return np.arange(run_list[0].first, run_list[0].first + run_list[0].count, dtype=np.int64)
    if len(run_list) <= SMALL:
        total = sum(r.count for r in run_list)
        if total <= SMALL:
            pages: list[int] = []
            for r in run_list:
                pages.extend(range(r.first, r.first + r.count))
            return np.array(pages, dtype=np.int64)
    firsts = np.fromiter((r.first for r in run_list), dtype=np.int64, count=len(run_list))
    counts = np.fromiter((r.count for r in run_list), dtype=np.int64, count=len(run_list))
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(firsts, counts) + offsets


def pair_stretches(src_pages: I64, dst_pages: I64, mode: Mode = "coalesced") -> I64:
    """Kx3 int64 rows (src_first, dst_first, count) covering the pairing src_pages[i] -> dst_pages[i]."""
    if src_pages.size != dst_pages.size:
        raise InvalidPagesError(
            f"page count mismatch: source has {src_pages.size} pages, destination {dst_pages.size}"
        )
    if mode == "per_page":
        ones = np.ones(src_pages.size, dtype=np.int64)
        return np.stack((src_pages, dst_pages, ones), axis=1)
    if mode != "coalesced":
        raise ValueError(f"unknown descriptor mode {mode!r}")
    n = src_pages.size
    if 0 < n <= SMALL:
        src, dst = src_pages.tolist(), dst_pages.tolist()
        rows = [(src[i], dst[i], count) for i, count in _small_stretches([src, dst], n)]
        return np.array(rows, dtype=np.int64)
    starts = _breaks(src_pages, dst_pages)
    counts = np.diff(np.append(starts, src_pages.size))
    return np.stack((src_pages[starts], dst_pages[starts], counts), axis=1)


def descriptors(
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    bytes_per_page: Sequence[int],
    src_pages: Sequence[int] | npt.NDArray[np.integer],
    dst_pages: Sequence[int] | npt.NDArray[np.integer],
    mode: Mode = "coalesced",
) -> U64:
    """Nx3 uint64 rows (src_addr, dst_addr, nbytes), buffer-major, one per stretch per buffer.

    Buffer b's page p lives at base[b] + p * bytes_per_page[b] on both sides.
    """
    nbuf = len(bytes_per_page)
    if len(src_bases) != nbuf or len(dst_bases) != nbuf:
        raise LayoutError(
            f"buffer count mismatch: source {len(src_bases)}, destination {len(dst_bases)}, page sizes {nbuf}"
        )
    stretches = pair_stretches(as_page_array(src_pages), as_page_array(dst_pages), mode).astype(np.uint64)
    bpp = np.asarray(bytes_per_page, dtype=np.uint64)[:, None]
    out = np.empty((nbuf, stretches.shape[0], 3), dtype=np.uint64)
    out[:, :, 0] = np.asarray(src_bases, dtype=np.uint64)[:, None] + stretches[None, :, 0] * bpp
    out[:, :, 1] = np.asarray(dst_bases, dtype=np.uint64)[:, None] + stretches[None, :, 1] * bpp
    out[:, :, 2] = stretches[None, :, 2] * bpp
    return out.reshape(-1, 3)
