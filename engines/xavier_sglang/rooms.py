"""The prefill side of one room, as SGLang's sender polls it. No SGLang import.

`bootstrap_room` is the Xavier room id. States are SGLang's `KVPoll` values (`KvPoll` has the same). The
messages are `wire`'s; the decode side is `reader.ReaderRoom`.

`SourceRoom`: BOOTSTRAPPING until the decode's JOIN arrived and its sender is a registered decode of this
contract (the hub loads it once per epoch) → WAITING_FOR_INPUT → `init(pages, aux slot)` → each
`send(chunk)` WRITEs that chunk's pages into the decode's destination pages at once (a NIXL WRITE, or a
CUDA IPC copy to a decode on this host: `push`), so chunked prefill overlaps the transfer with the next
chunk's compute; the last one's notification also carries the aux
slot (first token, metadata) → TRANSFERRING → SUCCESS once every WRITE is done (NIXL delivers each
WRITE's notification to the decode after its bytes).

A failure (SGLang's abort, the decode's CANCEL, a WRITE error, the decode leaving the directory) keeps
the room TRANSFERRING while any WRITE of it is in flight: the pages it reads are not SGLang's to reuse
yet (invariant I1). Then the decode is told FAILED (so it may reuse its pages) and the room is FAILED.
`failure` = (code, detail), code the Xavier reason or the room's end cause.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common.errors import InvalidPagesError, LayoutError, TransferError
from xavier_core.transfer.common.runs import as_page_array
from xavier_core.transfer.nixl.rooms import KvPoll

from . import wire
from .hub import Hub, PairPeer
from .push import IpcWrite, Write
from .trace import RoomTrace

__all__ = ["RoomFailure", "SourceRoom"]


@dataclass(frozen=True)
class RoomFailure:
    """Why a room failed: `code` is the Xavier reason, `detail` a sentence for logs."""

    code: str
    detail: str

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"

    @classmethod
    def parse(cls, text: str, default: str) -> RoomFailure:
        """A failure from its wire form `CODE: detail` (a FAILED message)."""
        code, sep, detail = text.partition(": ")
        if not sep or not code.replace("_", "").isalnum() or not code.isupper():
            return cls(default, text or "the peer failed the room")
        return cls(code, detail)


class SourceRoom:
    """The prefill side of one room (see the module docstring)."""

    def __init__(self, hub: Hub, room_id: int) -> None:
        self.hub = hub
        self.room_id = room_id
        self._lock = threading.Lock()
        self.created = time.monotonic()
        self.epoch = hub.peer[1]
        self.failure: RoomFailure | None = None
        self.trace = RoomTrace("prefill", room_id)
        self._join: wire.Message | None = None  # the registered decode's, once resolved
        self._join_from = ""
        self._joins: dict[str, wire.Message] = {}  # until then: by sending agent (a stranger may send one)
        self._decode: PairPeer | None = None
        self._num_pages = 0
        self._aux_slot: int | None = None
        self._sent = 0
        self._last_sent = False
        self._writes: list[Write] = []
        self._told = False
        self._done = False
        if not hub.add_room(room_id, self):
            self.failure = RoomFailure("ROOM_BUSY", f"room {room_id} is already live in this process")
            self._registered = False
        else:
            self._registered = True

    # --- SGLang's calls -----------------------------------------------------------------------

    def init(self, num_pages: int, aux_slot: int | None) -> None:
        with self._lock:
            self._num_pages = num_pages
            self._aux_slot = aux_slot
            self.trace.mark("init")
            join = self._join
            if self.failure is None and join is not None:
                self._check_count_locked(join)

    def send(self, pages: npt.NDArray[np.integer] | list[int]) -> None:
        """One chunk of pages, WRITTEN to the decode now; the last one's notification carries the aux
        slot. A chunk SGLang should not have sent fails the room (never SGLang's scheduler)."""
        try:
            chunk = as_page_array(pages)
        except TransferError as exc:
            self.fail(RoomFailure("INVALID_ARGUMENT", str(exc)))
            return
        self.hub.pump(force=True)  # a CANCEL that already came means: write nothing
        with self._lock:
            if self.failure is not None:
                return
            decode, join = self._decode, self._join
            if decode is None or join is None or join.pages is None:
                self._fail_locked(RoomFailure("FAILED_PRECONDITION", "send() before the decode joined"))
                return
            if self._last_sent:
                self._fail_locked(RoomFailure("FAILED_PRECONDITION", "send() after the last chunk"))
                return
            start, n = self._sent, int(chunk.size)
            if start + n > self._num_pages:
                self._fail_locked(
                    RoomFailure("INVALID_ARGUMENT", f"{start + n} pages sent, init said {self._num_pages}")
                )
                return
            last = start + n == self._num_pages
            aux = None
            try:
                if last and self._aux_slot is not None and join.aux_slot is not None:
                    aux = self.hub.read_aux_slot(self._aux_slot)  # SGLang filled it before the last send
                note = wire.written(self.room_id, join.token, n, aux=aux, last=last)
                if n:
                    dest = join.pages[start : start + n]
                    write = self.hub.write(decode, chunk, dest, note)
                    self._writes.append(write)
                    self.trace.mark("ipc_posted" if isinstance(write, IpcWrite) else "nixl_posted")
                elif last:
                    self.hub.send(decode, note)
            except (InvalidPagesError, LayoutError, ValueError) as exc:  # pages outside a pool, a bad slot
                self._fail_locked(RoomFailure("INVALID_ARGUMENT", str(exc)))
                return
            except TransferError as exc:  # NIXL refused the WRITE: the decode is gone
                self._fail_locked(RoomFailure("TRANSFER_FAILED", str(exc)))
                return
            self._sent += n
            self._last_sent = last
            if last:
                self.trace.mark("last_chunk")

    def poll(self) -> KvPoll:
        self.hub.pump()
        with self._lock:
            self.trace.polls += 1
            if self._done:
                return KvPoll.FAILED if self.failure is not None else KvPoll.SUCCESS
            if self.failure is None and self._decode is None:
                self._resolve_locked()
            in_flight = self._check_writes_locked()
            if self.failure is not None:
                if in_flight:
                    return KvPoll.TRANSFERRING
                self._tell_locked()
                self._done = True
                return KvPoll.FAILED
            if self._decode is None:
                return KvPoll.BOOTSTRAPPING
            if not self._last_sent:
                return KvPoll.TRANSFERRING if self._sent else KvPoll.WAITING_FOR_INPUT
            if in_flight:
                return KvPoll.TRANSFERRING
            self.trace.mark("success")
            self._done = True
            return KvPoll.SUCCESS

    def abort(self, detail: str = "aborted by SGLang") -> None:
        self.fail(RoomFailure("ROOM_END_CAUSE_PREFILL_FAILED", detail))

    def fail(self, failure: RoomFailure) -> None:
        """Ends the room with `failure` unless it already ended."""
        with self._lock:
            if self.failure is None and not self._done:
                self._fail_locked(failure)

    def in_flight(self) -> bool:
        """True while a WRITE of the room may still read its pages."""
        with self._lock:
            return self._check_writes_locked()

    def clear(self) -> None:
        """Forgets the room; one with a WRITE still in flight is kept by the hub until it ends."""
        with self._lock:
            self.trace.write("failed" if self.failure is not None else "success")
            busy = self._check_writes_locked()
            if self.failure is None and not self._done:
                self._fail_locked(RoomFailure("ROOM_END_CAUSE_PREFILL_FAILED", "cleared before it ended"))
            if not busy and self.failure is not None:
                self._tell_locked()
        if not self._registered:
            return
        if busy:
            self.hub.park(self)
        else:
            self._finish()

    # --- the hub's calls ------------------------------------------------------------------------

    def on_message(self, who: str, msg: wire.Message) -> None:
        with self._lock:
            if msg.kind == wire.Kind.JOIN and self._join is None:
                if len(self._joins) < 4:
                    self._joins.setdefault(who, msg)
            elif msg.kind == wire.Kind.CANCEL:
                if self._join is None and who in self._joins and self._joins[who].token == msg.token:
                    # Cancelled before it was resolved (the JOIN and the CANCEL came in one batch).
                    self._join, self._join_from = self._joins.pop(who), who
                    self._joins.clear()
                if self._join is None or who != self._join_from or msg.token != self._join.token:
                    self.hub.counters["rejected"] += 1
                elif self.failure is None and not self._done:
                    self._fail_locked(
                        RoomFailure("ROOM_END_CAUSE_DECODE_FAILED", "the decode gave the room up")
                    )
            else:
                self.hub.counters["rejected"] += 1

    def on_peer_lost(self, peer: PairPeer) -> None:
        self.fail(RoomFailure("ROOM_END_CAUSE_PEER_LOST", f"decode {peer.key} left the directory"))

    def counterpart(self) -> PairPeer | None:
        return self._decode

    def reap(self) -> bool:
        """For a parked room: True (and the decode told) once no WRITE of it is in flight."""
        with self._lock:
            if self._check_writes_locked():
                return False
            if self.failure is not None:
                self._tell_locked()
        return True

    # --- internals ----------------------------------------------------------------------------

    def _resolve_locked(self) -> None:
        for who, msg in self.hub.take_joins(self.room_id).items():
            self._joins.setdefault(who, msg)
        if not self._joins and self.hub.cancelled(self.room_id):
            self._fail_locked(
                RoomFailure("ROOM_END_CAUSE_DECODE_FAILED", "the decode gave the room up first")
            )
            return
        if self.hub.peer[1] != self.epoch:
            self._fail_locked(RoomFailure("STALE_EPOCH", "this prefill registered again: its rooms ended"))
            return
        for who, msg in self._joins.items():
            peer = self.hub.decode_peer(who)
            if peer is not None:
                self._decode, self._join, self._join_from = peer, msg, who
                self._joins.clear()
                self.trace.mark("decode_joined")
                if self._num_pages:  # init() came first
                    self._check_count_locked(msg)
                return
        if time.monotonic() - self.created > self.hub.settings.bootstrap_timeout_s:
            what = "the decode never joined" if not self._joins else "no registered decode joined"
            self._fail_locked(RoomFailure("DEADLINE_EXCEEDED", what))

    def _check_count_locked(self, join: wire.Message) -> None:
        """The decode must have reserved a page for every page of the prompt (whichever of the JOIN
        and SGLang's init() came first, this runs once both are here)."""
        if join.count != self._num_pages:
            self._fail_locked(
                RoomFailure(
                    "INVALID_ARGUMENT",
                    f"the decode reserved {join.count} pages, the prompt has {self._num_pages}",
                )
            )

    def _check_writes_locked(self) -> bool:
        """Polls the room's WRITEs; a failed one fails the room. True while any is in flight."""
        live = False
        for xfer in self._writes:
            if xfer.in_flight and xfer.poll() == "ERR" and self.failure is None:
                self._fail_locked(RoomFailure("TRANSFER_FAILED", f"WRITE to the decode failed: {xfer.error}"))
            live = live or xfer.in_flight
        if not live:
            self._writes = [x for x in self._writes if x.in_flight]
        return live

    def _fail_locked(self, failure: RoomFailure) -> None:
        self.failure = failure

    def _tell_locked(self) -> None:
        """Tells the decode once, when nothing of ours is in flight, that it may reuse its pages."""
        if self._told:
            return
        self._told = True
        failure = self.failure or RoomFailure("ROOM_END_CAUSE_PREFILL_FAILED", "the prefill failed")
        if failure.code == "ROOM_END_CAUSE_PEER_LOST":
            return
        joins = {self._join_from: self._join} if self._join is not None else dict(self._joins)
        for who, join in joins.items():
            self.hub.tell_failed(who, wire.failed(self.room_id, join.token, failure.code, failure.detail))

    def _finish(self) -> None:
        self.hub.remove_room(self.room_id, self)
