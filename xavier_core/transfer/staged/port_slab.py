"""A port's staging slab (see `staged.slab`): allocated and registered once, the source rooms that hold
chunks of it, when a room is staged at all, and the counters the stats report.

Owned by the port's NIXL thread, like the slab itself; the counters are read from the loop (plain ints).
"""

from __future__ import annotations

from collections.abc import Sequence

from xavier_core.runtime.errors import FailedPrecondition
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.runs import as_page_array, coalesce
from xavier_core.transfer.common.slab_layout import SlabLayout
from xavier_core.transfer.common.source import SourceInfo
from xavier_core.transfer.nixl.agent import NixlAgent
from xavier_core.transfer.staged.slab import Slab, View


class PortSlab:
    """The slab of one port, registered with its agent (before the agent's metadata leaves)."""

    def __init__(self, agent: NixlAgent, buffers: Sequence[KvBuffer], layout: SlabLayout) -> None:
        devices = {b.device for b in buffers}
        if len(devices) != 1:
            raise FailedPrecondition(f"staging needs one KV device, got {sorted(devices)}")
        self.slab = Slab(layout, devices.pop())
        agent.register_extra([self.slab.buffer], "staging slab")
        self.pool = View.of(buffers)  # the KV buffers, for gathers and scatters
        self._num_buffers = len(buffers)
        self._rooms: dict[int, list[int]] = {}  # source rooms' chunks
        self.staged_sources = 0
        self.mismatches = 0  # pulls whose source slab was cut differently

    def stage(
        self, room_id: int, info: SourceInfo, page_ids: Sequence[int], only_if_fewer: bool
    ) -> SourceInfo:
        """The room's pages gathered into free chunks, or `info` unchanged (page runs only): when
        `only_if_fewer` and the runs are no more descriptors than the chunks would be, or when the slab
        has too few free chunks (a fallback counted)."""
        pages = as_page_array(page_ids)
        needed = self.slab.layout.chunks_for(pages.size)
        if only_if_fewer and len(info.runs) * self._num_buffers <= needed:
            return info
        chunks = self.slab.alloc(needed)
        if chunks is None:
            return info
        self._rooms[room_id] = chunks
        self.slab.gather(self.pool, pages, chunks)  # finished before the descriptor leaves (I1)
        self.staged_sources += 1
        return SourceInfo(
            info.agent_name, info.metadata, info.buffers, info.runs, info.token,
            tuple(coalesce(chunks)), self.slab.buffer,
        )  # fmt: skip

    def holds(self, room_id: int) -> bool:
        """Whether a published room holds chunks (released when it is unpublished)."""
        return room_id in self._rooms

    def release(self, room_id: int) -> None:
        """The room is unpublished: no read can touch its chunks any more (idempotent)."""
        chunks = self._rooms.pop(room_id, None)
        if chunks is not None:
            self.slab.free(chunks)

    def matches(self, info: SourceInfo) -> bool:
        """Whether a staged source's chunks fit this slab's ring (same pages per chunk, same page record);
        a mismatch is counted, and the pull reads page runs, whose READ checks the layouts itself."""
        _, layout = info.staging_slab()  # checked in SourceInfo.from_proto
        mine = self.slab.layout
        if (layout.chunk_pages, layout.sizes) == (mine.chunk_pages, mine.sizes):
            return True
        self.mismatches += 1
        return False

    @property
    def fallbacks(self) -> int:
        return self.slab.fallbacks + self.mismatches

    def stats(self) -> dict[str, int]:
        layout = self.slab.layout
        return {
            "slab_bytes": layout.nbytes,
            "chunk_bytes": layout.chunk_bytes,
            "bytes_in_use": self.slab.bytes_in_use,
            "staged_sources": self.staged_sources,
            "fallbacks": self.fallbacks,
        }
