"""One room seen from each side, as SGLang's sender and receiver poll it. No SGLang import.

`bootstrap_room` is the Xavier room id. States are SGLang's `KVPoll` values (`KvPoll` has the same).

Source (prefill), `SourceRoom`:
  BOOTSTRAPPING until the room's decode has joined (its BeginTransfer opened or adopted the room; the
  hub's feed shows it) → WAITING_FOR_INPUT → `init(pages, aux slot)`, `send(chunk)`… (chunked prefill
  sends several chunks; the source is published once, with every page, after the last) → PublishSource
  → TRANSFERRING → SUCCESS when the reader's done notification arrives or the room COMPLETED.

Reader (decode), `ReaderRoom`:
  BOOTSTRAPPING until `init` names the prefill peer → WAITING_FOR_INPUT → `send_metadata(pages, aux
  slot)` reserves the destination and calls BeginTransfer (waiting in the directory for the source) →
  READ of the aux slot, then of the pages (TRANSFERRING) → CompleteRoom → SUCCESS.

Every failure ends the room in the directory with its cause and keeps `failure` = (code, detail), where
code is the Xavier reason (an ErrorInfo reason of a failed RPC, or the room's end cause).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.directory.client import TERMINAL_ROOM_STATES
from xavier_core.runtime.errors import XavierError
from xavier_core.transfer.errors import TransferError
from xavier_core.transfer.kv_transfer import KvPoll, KvSender
from xavier_core.transfer.runs import as_page_array

from .hub import Hub
from .trace import RoomTrace

__all__ = ["RoomFailure", "SourceRoom"]

_PROBE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RoomFailure:
    """Why a room failed: `code` is the Xavier reason, `detail` a sentence for logs."""

    code: str
    detail: str

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


def _ended(room: dpb.Room) -> RoomFailure:
    cause = dpb.RoomEndCause.Name(room.end_cause)
    return RoomFailure(
        cause, room.end_detail or f"room {room.room_id} ended {dpb.RoomState.Name(room.state)}"
    )


def _rpc_failure(fut: concurrent.futures.Future[Any], what: str) -> RoomFailure | None:
    exc = fut.exception()
    if exc is None:
        return None
    if isinstance(exc, XavierError):
        return RoomFailure(exc.reason, f"{what}: {exc.message or exc}")
    return RoomFailure("UNAVAILABLE", f"{what}: {type(exc).__name__}: {exc}")


class SourceRoom:
    """The prefill side of one room (see the module docstring)."""

    def __init__(self, hub: Hub, room_id: int) -> None:
        self.hub = hub
        self.room_id = room_id
        self._lock = threading.Lock()
        self.kv = KvSender(hub.kv, str(room_id))
        self.created = time.monotonic()
        self.failure: RoomFailure | None = None
        self._decode: tuple[str, int] | None = None
        self._num_pages = 0
        self._aux_slot: int | None = None
        self._chunks: list[npt.NDArray[np.int64]] = []
        self._sent = 0
        self._publish: concurrent.futures.Future[dpb.Room] | None = None
        self._ended = False
        self._probe: concurrent.futures.Future[dpb.Room] | None = None
        self._probed = float("-inf")
        self.trace = RoomTrace("prefill", room_id)

    def init(self, num_pages: int, aux_slot: int | None) -> None:
        with self._lock:
            self._num_pages = num_pages
            self._aux_slot = aux_slot
            self.kv.init(num_pages)
            self.trace.mark("init")

    def send(self, pages: npt.NDArray[np.integer] | list[int]) -> None:
        """One chunk of pages; the source is published with all of them after the last chunk."""
        chunk = as_page_array(pages)
        with self._lock:
            if self.failure is not None:
                return
            if self._publish is not None:
                raise TransferError(f"room {self.room_id}: send() after the last chunk")
            self._chunks.append(chunk)
            self._sent += int(chunk.size)
            if self._sent > self._num_pages:
                self._fail_locked(
                    RoomFailure("INVALID_ARGUMENT", f"{self._sent} pages sent, init said {self._num_pages}")
                )
                return
            if self._sent < self._num_pages:
                return
            if self._decode is None:
                self._fail_locked(
                    RoomFailure("FAILED_PRECONDITION", "send() before the decode joined the room")
                )
                return
            all_pages = np.concatenate(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
            try:
                info = self.kv.send(all_pages)
            except TransferError as exc:  # pages outside the pool, a count that differs from init()
                self._fail_locked(RoomFailure("INVALID_ARGUMENT", str(exc)))
                return
            desc = info.to_proto(self.hub.fingerprint)
            if self._aux_slot is not None:
                desc.aux_runs.add(first_page=self._aux_slot, count=1)
            self.trace.mark("last_chunk")
            self.hub.publishing(+1)
            self._publish = self.hub.submit_room(
                self.hub.client.publish_source(
                    self.room_id, self.hub.peer, self._decode, desc, request_id=f"sgl-{self.room_id}-publish"
                )
            )

    def poll(self) -> KvPoll:
        with self._lock:
            self.trace.polls += 1
            if self.failure is not None:
                return KvPoll.FAILED
            room = self.hub.room(self.room_id)
            if self._decode is None:
                if room is not None and room.decode_peer_id and room.state not in TERMINAL_ROOM_STATES:
                    self._decode = (room.decode_peer_id, int(room.decode_epoch))
                    self.trace.mark("decode_joined")
                elif room is not None and room.state in TERMINAL_ROOM_STATES:
                    self._fail_locked(_ended(room))
                    return KvPoll.FAILED
                elif time.monotonic() - self.created > self.hub.settings.bootstrap_timeout_s:
                    self._fail_locked(RoomFailure("DEADLINE_EXCEEDED", "the decode never joined the room"))
                    return KvPoll.FAILED
                else:
                    self._probe_locked()
                    return KvPoll.BOOTSTRAPPING
            if self._publish is not None and self._publish.done():
                failed = _rpc_failure(self._publish, "PublishSource")
                if failed is not None:
                    self._fail_locked(failed)
                    return KvPoll.FAILED
                room = self.hub.room(self.room_id)  # the answer is in by now
                self.trace.mark("published")
            if room is not None and room.state == dpb.ROOM_STATE_COMPLETED:
                self.kv.mark_complete()
            elif room is not None and room.state in TERMINAL_ROOM_STATES:
                self._fail_locked(_ended(room))
                return KvPoll.FAILED
            state = self.kv.poll()
            if state == KvPoll.FAILED:
                self._fail_locked(RoomFailure("TRANSFER_FAILED", self.kv.error or "the reader failed"))
                return KvPoll.FAILED
            if state == KvPoll.SUCCESS:
                self.trace.mark("success")
                self._end_locked()
                return KvPoll.SUCCESS
            return KvPoll.WAITING_FOR_INPUT if self._publish is None else KvPoll.TRANSFERRING

    def _probe_locked(self) -> None:
        """Asks the directory for the room now and then while no view of it has come: a room ended
        before anyone opened it (a tombstone) reaches no peer's feed."""
        if self._probe is not None and self._probe.done():
            self._probe = None  # its answer is in the feed; NOT_FOUND: nobody opened the room yet
        now = time.monotonic()
        if self._probe is None and now - self._probed >= _PROBE_INTERVAL_S:
            self._probed = now
            self._probe = self.hub.submit_room(self.hub.client.get_room(self.room_id))

    def abort(self, detail: str = "aborted by SGLang") -> None:
        self.fail(RoomFailure("ROOM_END_CAUSE_PREFILL_FAILED", detail))

    def fail(self, failure: RoomFailure) -> None:
        """Ends the room with `failure` unless it already ended."""
        with self._lock:
            if self.failure is None and self.kv.peek()[0] != KvPoll.SUCCESS:
                self._fail_locked(failure)

    def in_flight(self) -> bool:
        """True while the reader may still be reading the published pages."""
        return self.kv.in_flight()

    def clear(self) -> None:
        with self._lock:
            self.trace.write("failed" if self.failure is not None else "success")
            self._end_locked()
            self.kv.clear()
            self.hub.forget_room(self.room_id)

    def _fail_locked(self, failure: RoomFailure) -> None:
        self.failure = failure
        self.kv.abort(str(failure))
        if not failure.code.startswith("ROOM_END_CAUSE_") or failure.code == "ROOM_END_CAUSE_PREFILL_FAILED":
            self.hub.submit(
                self.hub.client.abort_room(
                    self.room_id, dpb.ROOM_END_CAUSE_PREFILL_FAILED, failure.detail[:1000], *self.hub.peer
                )
            )
        self._end_locked()

    def _end_locked(self) -> None:
        if self._publish is not None and not self._ended:
            self._ended = True
            self.hub.publishing(-1)
