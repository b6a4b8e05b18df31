"""The decode side of one room, as SGLang's receiver polls it (the prefill side is `rooms.SourceRoom`).

BOOTSTRAPPING until `init` names the prefill (the manager found it in the directory and loaded its NIXL
agent) → WAITING_FOR_INPUT → `send_metadata(pages, aux slot)` sends the prefill a JOIN naming them →
TRANSFERRING while the prefill WRITEs → SUCCESS once every page was written and the aux slot arrived
(each WRITE's notification arrives after its bytes; the last carries the prefill's aux slot, which is
copied into ours). No directory call and no READ: the scheduler's polls only
read what the hub's `pump` routed here.

A failure (SGLang's abort, the prefill's FAILED, the wait for the prefill's WRITEs running out) ends the
room, but the room reports TRANSFERRING until no WRITE of the prefill can still land in its pages
(invariant I1): the prefill answered FAILED (sent only once nothing of the room is in flight there), the
prefill left the directory, or a CANCEL went unanswered for the transfer timeout. Only then FAILED, and
SGLang hands the pages to another request.
"""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common.errors import TransferError
from xavier_core.transfer.common.runs import as_page_array
from xavier_core.transfer.nixl.rooms import KvPoll

from . import wire
from .hub import Hub, PairPeer
from .rooms import RoomFailure
from .trace import RoomTrace

__all__ = ["ReaderRoom"]

# Failures that say the named prefill epoch is gone: a request for the same bootstrap address must look
# the prefill up again.
_PREFILL_GONE = frozenset(("PEER_NOT_FOUND", "STALE_EPOCH", "PEER_UNAVAILABLE", "ROOM_END_CAUSE_PEER_LOST"))


class ReaderRoom:
    """The decode side of one room (see the module docstring)."""

    def __init__(self, hub: Hub, room_id: int) -> None:
        self.hub = hub
        self.room_id = room_id
        self._lock = threading.Lock()
        self.token = secrets.token_bytes(wire.TOKEN_BYTES)
        self.failure: RoomFailure | None = None
        self.prefill: PairPeer | None = None
        self.trace = RoomTrace("decode", room_id)
        self._state = KvPoll.BOOTSTRAPPING
        self._pages = 0
        self._aux_slot: int | None = None
        self._written = 0
        self._aux_written = False
        self._joined: float | None = None
        self._progress = 0.0  # when the last WRITE arrived (or the JOIN went out)
        self._released = False  # nothing of the prefill's can land in our pages any more
        self._cancelled: float | None = None
        self._registered = False

    # --- SGLang's calls -----------------------------------------------------------------------

    def init(self, prefill: PairPeer | None) -> None:
        with self._lock:
            if prefill is None:
                self._fail_locked(
                    RoomFailure("PEER_UNAVAILABLE", "no prefill is registered at this bootstrap address")
                )
                return
            self.prefill = prefill
            self._state = KvPoll.WAITING_FOR_INPUT
            self.trace.mark("init")

    def send_metadata(self, pages: npt.NDArray[np.integer] | list[int], aux_slot: int | None) -> None:
        with self._lock:
            if self.failure is not None or self.prefill is None or self._joined is not None:
                return
            try:
                dest = as_page_array(pages)
                limit = min(b.num_pages for b in self.hub.pool.kv)
                if dest.size and int(dest.max()) >= limit:
                    raise TransferError(f"destination page {int(dest.max())} is outside the pool ({limit})")
                if np.unique(dest).size != dest.size:
                    raise TransferError("destination page ids repeat")
            except TransferError as exc:
                self._fail_locked(RoomFailure("INVALID_ARGUMENT", str(exc)))
                return
            if not self.hub.add_room(self.room_id, self):
                self._fail_locked(RoomFailure("ROOM_BUSY", f"room {self.room_id} is already live here"))
                return
            self._registered = True
            self._pages, self._aux_slot = int(dest.size), aux_slot
            self.trace.mark("metadata")
            if not self.hub.send(self.prefill, wire.join(self.room_id, self.token, dest, aux_slot)):
                self._fail_locked(
                    RoomFailure("PEER_UNAVAILABLE", f"prefill {self.prefill.key} is unreachable")
                )
                return
            self._joined = self._progress = time.monotonic()
            self._state = KvPoll.TRANSFERRING

    def poll(self) -> KvPoll:
        self.hub.pump()
        with self._lock:
            self.trace.polls += 1
            if self._state in (KvPoll.SUCCESS, KvPoll.FAILED):
                return self._state
            now = time.monotonic()
            if self.failure is None and self._joined is not None:
                if self._written >= self._pages and (self._aux_written or self._aux_slot is None):
                    self.trace.mark("success")
                    self._state = KvPoll.SUCCESS
                    return self._state
                if now - self._progress > self.hub.settings.waiting_timeout_s:
                    self._fail_locked(
                        RoomFailure("DEADLINE_EXCEEDED", "the prefill's KV did not arrive in time")
                    )
            if self.failure is not None:
                if self._safe_locked(now):
                    self._state = KvPoll.FAILED
                    return self._state
                return KvPoll.TRANSFERRING
            return self._state

    def abort(self, detail: str = "aborted by SGLang") -> None:
        self.fail(RoomFailure("ROOM_END_CAUSE_DECODE_FAILED", detail))

    def fail(self, failure: RoomFailure) -> None:
        """Ends the room with `failure` unless it already ended."""
        with self._lock:
            if self.failure is None and self._state != KvPoll.SUCCESS:
                self._fail_locked(failure)

    def release_safe(self) -> bool:
        """True once no WRITE of the prefill can still land in this room's pages (KV or aux)."""
        with self._lock:
            return self._state == KvPoll.SUCCESS or self._safe_locked(time.monotonic())

    @property
    def prefill_gone(self) -> bool:
        """True when the room failed because the prefill epoch it named is no longer registered (it
        stopped, restarted as a new peer, or registered again with a new epoch)."""
        return self.failure is not None and self.failure.code in _PREFILL_GONE

    def clear(self) -> None:
        """Forgets the room; one the prefill may still write into is kept by the hub until it may not."""
        with self._lock:
            self.trace.write("success" if self._state == KvPoll.SUCCESS else "failed")
            if self._state != KvPoll.SUCCESS and self.failure is None:
                self._fail_locked(RoomFailure("ROOM_END_CAUSE_DECODE_FAILED", "cleared before it ended"))
            safe = self._state == KvPoll.SUCCESS or self._safe_locked(time.monotonic())
        if not self._registered:
            return
        if safe:
            self.hub.remove_room(self.room_id, self)
        else:
            self.hub.park(self)

    # --- the hub's calls ------------------------------------------------------------------------

    def on_message(self, who: str, msg: wire.Message) -> None:
        with self._lock:
            if self.prefill is None or who != self.prefill.agent or msg.token != self.token:
                self.hub.counters["rejected"] += 1
                return
            if msg.kind == wire.Kind.WRITTEN:
                self._progress = time.monotonic()
                self._written += msg.count
                if msg.count:
                    self.trace.mark("first_write")
                if msg.aux is not None and self._aux_slot is not None and self.failure is None:
                    try:
                        self.hub.write_aux_slot(self._aux_slot, msg.aux)
                    except ValueError as exc:  # another slot geometry than ours
                        self._fail_locked(RoomFailure("INVALID_ARGUMENT", f"aux slot: {exc}"))
                        return
                    self._aux_written = True
            elif msg.kind == wire.Kind.FAILED:
                self._released = True
                if self.failure is None and self._state != KvPoll.SUCCESS:
                    self._fail_locked(RoomFailure.parse(msg.detail, "ROOM_END_CAUSE_PREFILL_FAILED"))
            else:
                self.hub.counters["rejected"] += 1

    def on_peer_lost(self, peer: PairPeer) -> None:
        with self._lock:
            self._released = True  # a process that left the directory writes nothing more
            if self.failure is None and self._state != KvPoll.SUCCESS:
                self._fail_locked(
                    RoomFailure("ROOM_END_CAUSE_PEER_LOST", f"prefill {peer.key} left the directory")
                )

    def counterpart(self) -> PairPeer | None:
        return self.prefill if self._joined is not None else None

    def reap(self) -> bool:
        with self._lock:
            return self._safe_locked(time.monotonic())

    # --- internals ----------------------------------------------------------------------------

    def _safe_locked(self, now: float) -> bool:
        if self._joined is None or self._released:
            return True
        # A CANCEL the prefill never answered: its WRITEs are bounded by the transfer timeout.
        return self._cancelled is not None and now - self._cancelled > self.hub.settings.transfer_timeout_s

    def _fail_locked(self, failure: RoomFailure) -> None:
        self.failure = failure
        if self._joined is not None and not self._released and self._cancelled is None:
            self._cancelled = time.monotonic()
            if self.prefill is not None and not self.hub.send(
                self.prefill, wire.cancel(self.room_id, self.token)
            ):
                self._released = True  # the prefill is unreachable: NIXL refused to talk to it
