"""The reader's side of the staged transport (see `staged.slab`): one pull, as a state machine the port's
NIXL thread steps between its polls.

A pull holds a ring of local slab chunks (up to `PIPELINE_DEPTH`). It posts one NIXL READ per source
chunk into a free ring chunk; whenever a READ ends, its chunk is scattered to the destination pages and
the ring chunk takes the next source chunk, so chunk i+1 is on the wire while chunk i is scattered.
The source learns the end by a standalone NIXL notification sent once every READ has ended (never on a
READ, which would say "done" before the other READs have ended), so its slab stays pinned until then.

I1 on the reader: a ring chunk takes the next READ, or goes back to the slab, only when no READ into it
is in flight and its scatter has finished (on VRAM the scatter's CUDA event, polled, never waited on);
the pull succeeds only once every scatter has finished. An aborted pull posts nothing more, waits for
the READs and scatters in flight (each READ bounded by its transfer timeout), then returns the ring and
tells the source the read failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from xavier_core.runtime.logging import get_logger
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError, LayoutError, TransferError
from xavier_core.transfer.common.slab_layout import SlabLayout
from xavier_core.transfer.nixl.agent import NixlAgent
from xavier_core.transfer.nixl.rooms import KvPoll, done_notif, fail_notif
from xavier_core.transfer.nixl.xfer import Transfer
from xavier_core.transfer.staged.slab import I64, Slab, View

if TYPE_CHECKING:
    from xavier_core.transfer.cuda.copy import CopyHandle

log = get_logger(__name__)

PIPELINE_DEPTH = 4  # ring chunks per pull: READs in flight while one chunk is scattered


class StagedRead:
    """One pull over the staged transport. Owned by the NIXL thread: `start`, then `step` until it
    returns SUCCESS or FAILED; `abort` any time."""

    def __init__(
        self,
        agent: NixlAgent,
        slab: Slab,
        pool: View,
        peer: str,
        remote: KvBuffer,
        remote_layout: SlabLayout,
        src_chunks: I64,
        dest_pages: I64,
        ring: list[int],
        room: str,
        token: str,
        timeout_s: float,
    ) -> None:
        if (remote_layout.chunk_pages, remote_layout.sizes) != (slab.layout.chunk_pages, slab.layout.sizes):
            raise LayoutError("the source's slab chunks differ in pages or page record from the reader's")
        if src_chunks.size != slab.layout.chunks_for(dest_pages.size):
            raise InvalidPagesError(f"{src_chunks.size} slab chunks for {dest_pages.size} pages")
        if int(dest_pages.max()) >= pool.num_pages or np.unique(dest_pages).size != dest_pages.size:
            raise InvalidPagesError("destination pages repeat or lie outside the pool")
        self.agent, self.slab, self.pool, self.peer = agent, slab, pool, peer
        self.remote, self.src_chunks, self.dest = remote, src_chunks, dest_pages
        self.ring = ring
        self.room, self.token, self.timeout_s = room, token, timeout_s
        self._free_ring = list(ring)
        self._posted: dict[int, tuple[Transfer, int]] = {}  # ring chunk -> (READ, source chunk index)
        self._scattering: dict[int, CopyHandle] = {}  # ring chunk -> its scatter, until done
        self._next = 0
        self._scattered = 0
        self.error: str | None = None
        self.result: KvPoll | None = None

    @property
    def in_flight(self) -> bool:
        """True while a READ may still write a ring chunk or a scatter still read one."""
        return bool(self._posted or self._scattering)

    def start(self) -> None:
        while self._free_ring and self._next < self.src_chunks.size and self.error is None:
            self._post(self._free_ring.pop())

    def step(self) -> KvPoll:
        """Polls the READs and scatters, scatters the chunks that arrived, posts the next; the state."""
        if self.result is not None:
            return self.result
        for local, handle in list(self._scattering.items()):
            if handle.is_done():
                del self._scattering[local]
                self._reuse(local)
        for local, (xfer, i) in list(self._posted.items()):
            state = xfer.poll()
            if state == "PROC":
                continue
            del self._posted[local]
            if state == "ERR":
                self._fail(f"READ of slab chunk {i} failed: {xfer.error}")
            scatter: CopyHandle | None = None
            if self.error is None:
                try:
                    scatter = self._scatter(local, i)
                except (RuntimeError, ValueError, IndexError, TransferError) as exc:
                    self._fail(f"scatter of slab chunk {i} failed: {exc}")
            if scatter is not None:
                self._scattering[local] = scatter
            else:
                self._reuse(local)
        if self.error is not None and not self.in_flight:
            self._end(KvPoll.FAILED)
        elif self._scattered == self.src_chunks.size and not self._scattering:
            self._end(KvPoll.SUCCESS)
        return self.result or KvPoll.TRANSFERRING

    def _reuse(self, local: int) -> None:
        """A ring chunk nothing touches any more: the next source chunk goes into it."""
        self._free_ring.append(local)
        if self.error is None and self._next < self.src_chunks.size:
            self._post(self._free_ring.pop())

    def abort(self, reason: str = "aborted") -> None:
        """Posts nothing more; the pull fails once the READs in flight have ended."""
        if self.result is None:
            self._fail(reason)

    def _post(self, local: int) -> None:
        i = self._next
        self._next += 1
        cp = self.slab.layout.chunk_pages
        nbytes = min(cp, self.dest.size - i * cp) * self.slab.layout.record_bytes
        chunk_bytes = self.slab.layout.chunk_bytes
        row = (
            self.remote.addr + int(self.src_chunks[i]) * chunk_bytes,
            self.slab.buffer.addr + local * chunk_bytes,
            nbytes,
        )
        try:
            xfer = self.agent.read_ranges(
                self.peer,
                self.remote.device,
                self.slab.device,
                np.array([row], dtype=np.uint64),
                timeout_s=self.timeout_s,
            )
        except TransferError as exc:
            self._free_ring.append(local)
            self._fail(f"READ of slab chunk {i} not posted: {exc}")
            return
        self._posted[local] = (xfer, i)

    def _scatter(self, local: int, i: int) -> CopyHandle | None:
        cp = self.slab.layout.chunk_pages
        handle = self.slab.scatter(self.pool, self.dest[i * cp : (i + 1) * cp], local)
        self._scattered += 1
        return handle

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
            log.info("staged read failed", room=self.room, error=reason)

    def _end(self, result: KvPoll) -> None:
        """Nothing touches the ring any more: return it, then tell the source (its slab is free)."""
        self.result = result
        self.slab.free(self.ring)
        self.ring = []
        make = done_notif if result == KvPoll.SUCCESS else fail_notif
        try:
            self.agent.notify_read_end(self.peer, make(self.room, self.token))
        except TransferError as exc:
            log.info("read-end notification not delivered", room=self.room, error=str(exc))
