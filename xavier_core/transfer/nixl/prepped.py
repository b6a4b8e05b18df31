"""Prepared NIXL descriptor lists: every page of every buffer of one side, prepared once, so a transfer
names its pages by index.

`initialize_xfer` builds and validates both descriptor lists on every transfer; a prepared list is built
and validated once per registration (the local side) or per peer epoch and buffer set (a remote side).
Descriptor `b * num_pages + p` is page `p` of buffer `b`; NIXL merges consecutive descriptors whose bytes
are contiguous on both sides, so a run of pages contiguous on both sides still moves as one descriptor
per buffer, as `runs.descriptors` would have made it.

A side larger than `MAX_PREPPED_DESCRIPTORS` is not prepared (its list would hold that many NIXL
descriptors for the life of the epoch); its transfers build their lists per transfer as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common import runs
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.nixl._raw import MemType, RawAgent

MAX_PREPPED_DESCRIPTORS = 1 << 20
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PreppedSide:
    """One side's prepared list: `num_pages` descriptors per buffer, buffer-major."""

    handle: object
    num_pages: int
    num_buffers: int

    def indices(self, pages: I64) -> npt.NDArray[np.int32]:
        """Descriptor indices of `pages` (already range-checked) in every buffer, buffer-major."""
        firsts = np.arange(self.num_buffers, dtype=np.int64)[:, None] * self.num_pages
        return (firsts + pages[None, :]).ravel().astype(np.int32)


def preparable(buffers: Sequence[KvBuffer], num_pages: int) -> bool:
    """True when a list of every page of every buffer stays under the descriptor cap."""
    return 0 < len(buffers) * num_pages <= MAX_PREPPED_DESCRIPTORS


def prep_side(
    raw: RawAgent,
    agent_name: str,
    buffers: Sequence[KvBuffer],
    num_pages: int,
    mem: MemType,
    devs: Sequence[int],
) -> PreppedSide:
    """Prepares pages `0..num_pages` of every buffer (`devs[b]`: buffer b's device id); `agent_name` is
    "" for the local side."""
    bases = np.array([b.addr for b in buffers], dtype=np.uint64)[:, None]
    sizes = np.array([b.bytes_per_page for b in buffers], dtype=np.uint64)[:, None]
    pages = np.arange(num_pages, dtype=np.uint64)[None, :]
    table = np.empty((len(buffers), num_pages, 3), dtype=np.uint64)
    table[:, :, 0] = bases + pages * sizes
    table[:, :, 1] = sizes
    table[:, :, 2] = np.array(devs, dtype=np.uint64)[:, None]
    handle = raw.prep(agent_name, table.reshape(-1, 3), mem)
    return PreppedSide(handle, num_pages, len(buffers))


def stretch_count(remote: I64, local: I64) -> int:
    """How many stretches contiguous on both sides the pairing remote[i] <-> local[i] has (what NIXL's
    merge leaves per buffer)."""
    if remote.size == 0:
        return 0
    if remote.size <= runs.SMALL:
        return len(runs._small_breaks([remote.tolist(), local.tolist()], remote.size))
    breaks = (np.diff(remote) != 1) | (np.diff(local) != 1)
    return 1 + int(np.count_nonzero(breaks))


def all_distinct(pages: I64) -> bool:
    """True when no page id repeats; ascending lists (the common case) need no sort."""
    if pages.size < 2:
        return True
    if pages.size <= runs.SMALL:
        return len(set(pages.tolist())) == pages.size
    step = np.diff(pages)
    if bool((step > 0).all()):
        return True
    ordered = np.sort(pages)
    return bool((ordered[1:] != ordered[:-1]).all())
