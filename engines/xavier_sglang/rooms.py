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
from xavier_core.transfer.aux_slots import aux_from_proto
from xavier_core.transfer.errors import TransferError
from xavier_core.transfer.kv_transfer import KvPoll, KvReceiver, KvSender, fail_notif
from xavier_core.transfer.peers import peer_key
from xavier_core.transfer.runs import as_page_array
from xavier_core.transfer.source import SourceInfo
from xavier_core.transfer.xfer import Transfer

from .hub import Hub

__all__ = ["ReaderRoom", "RoomFailure", "SourceRoom"]


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
        self._published = False
        self._ended = False
        self.pages_sent = 0

    def init(self, num_pages: int, aux_slot: int | None) -> None:
        with self._lock:
            self._num_pages = num_pages
            self._aux_slot = aux_slot
            self.kv.init(num_pages)

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
            self.pages_sent = int(all_pages.size)
            self.hub.publishing(+1)
            self._published = True
            self._publish = self.hub.submit(
                self.hub.client.publish_source(
                    self.room_id, self.hub.peer, self._decode, desc, request_id=f"sgl-{self.room_id}-publish"
                )
            )

    def poll(self) -> KvPoll:
        with self._lock:
            if self.failure is not None:
                return KvPoll.FAILED
            room = self.hub.room(self.room_id)
            if self._decode is None:
                if room is not None and room.decode_peer_id and room.state not in TERMINAL_ROOM_STATES:
                    self._decode = (room.decode_peer_id, int(room.decode_epoch))
                elif room is not None and room.state in TERMINAL_ROOM_STATES:
                    self._fail_locked(_ended(room))
                    return KvPoll.FAILED
                elif time.monotonic() - self.created > self.hub.settings.bootstrap_timeout_s:
                    self._fail_locked(RoomFailure("DEADLINE_EXCEEDED", "the decode never joined the room"))
                    return KvPoll.FAILED
                else:
                    return KvPoll.BOOTSTRAPPING
            if self._publish is not None and self._publish.done():
                failed = _rpc_failure(self._publish, "PublishSource")
                if failed is not None:
                    self._fail_locked(failed)
                    return KvPoll.FAILED
                self.hub.note_room(self._publish.result())
                room = self.hub.room(self.room_id)
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
                self._end_locked()
                return KvPoll.SUCCESS
            return KvPoll.WAITING_FOR_INPUT if self._publish is None else KvPoll.TRANSFERRING

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
        if self._published and not self._ended:
            self._ended = True
            self.hub.publishing(-1)


class ReaderRoom:
    """The decode side of one room (see the module docstring)."""

    def __init__(self, hub: Hub, room_id: int) -> None:
        self.hub = hub
        self.room_id = room_id
        self._lock = threading.Lock()
        self.kv = KvReceiver(hub.kv, str(room_id))
        self.failure: RoomFailure | None = None
        self.prefill: tuple[str, int] | None = None
        self._state = KvPoll.BOOTSTRAPPING
        self._aux_slot: int | None = None
        self._begin: concurrent.futures.Future[dpb.BeginTransferResponse] | None = None
        self._source: SourceInfo | None = None
        self._aux: Transfer | None = None
        self._complete: concurrent.futures.Future[dpb.Room] | None = None
        self._read_posted = False
        self._notify_fail_later = False
        self.bytes_read = 0
        self.started: float | None = None
        self.finished: float | None = None

    def init(self, prefill: tuple[str, int] | None) -> None:
        with self._lock:
            if prefill is None:
                self._fail_locked(
                    RoomFailure("PEER_UNAVAILABLE", "no prefill is registered at this bootstrap address")
                )
                return
            self.prefill = prefill
            self._state = KvPoll.WAITING_FOR_INPUT

    def send_metadata(self, pages: npt.NDArray[np.integer] | list[int], aux_slot: int | None) -> None:
        with self._lock:
            if self.failure is not None or self.prefill is None:
                return
            try:
                self.kv.init()
                self.kv.send_metadata(pages)
            except TransferError as exc:  # malformed page ids
                self._fail_locked(RoomFailure("INVALID_ARGUMENT", str(exc)), read_posted=False)
                return
            self._aux_slot = aux_slot
            self._begin = self.hub.submit(
                self.hub.client.begin_transfer(
                    self.room_id,
                    self.prefill,
                    self.hub.peer,
                    request_id=f"sgl-{self.room_id}-begin",
                    wait_for_source=self.hub.settings.waiting_timeout_s,
                    source_endpoint_cached=self.hub.endpoint(self.prefill) is not None,
                )
            )

    def poll(self) -> KvPoll:
        with self._lock:
            if self.failure is not None or self._state == KvPoll.SUCCESS:
                return self._state
            if self._begin is not None and self._source is None and self._begin.done():
                if self.prefill is not None:
                    self._start_locked(self._begin, self.prefill)
            if self._aux is not None and self._state == KvPoll.TRANSFERRING:
                self._after_aux_locked()
            if self._read_posted and self._complete is None and self.failure is None:
                state = self.kv.poll()
                if state == KvPoll.FAILED:
                    self._fail_locked(RoomFailure("TRANSFER_FAILED", self.kv.error or "READ failed"))
                elif state == KvPoll.SUCCESS:
                    self.finished = time.monotonic()
                    self._complete = self.hub.submit(
                        self.hub.client.complete_room(
                            self.room_id,
                            *self.hub.peer,
                            bytes_transferred=self.bytes_read,
                            transfer_seconds=self.finished - (self.started or self.finished),
                            request_id=f"sgl-{self.room_id}-complete",
                        )
                    )
            if self._complete is not None and self._complete.done() and self.failure is None:
                failed = _rpc_failure(self._complete, "CompleteRoom")
                if failed is not None:
                    self._fail_locked(failed)
                else:
                    self._state = KvPoll.SUCCESS
            return self._state

    def _start_locked(
        self, begin: concurrent.futures.Future[dpb.BeginTransferResponse], prefill: tuple[str, int]
    ) -> None:
        failed = _rpc_failure(begin, "BeginTransfer")
        if failed is not None:
            self._fail_locked(failed, read_posted=False)
            return
        resp = begin.result()
        room = resp.room
        if room.state in TERMINAL_ROOM_STATES:
            self._fail_locked(_ended(room), read_posted=False, tell_directory=False)
            return
        if room.source.contract_fingerprint != self.hub.fingerprint:
            self._fail_locked(
                RoomFailure("LAYOUT_MISMATCH", "the source pages were computed under another KV layout")
            )
            return
        endpoint = self.hub.endpoint(prefill)
        if endpoint is None:
            endpoint = resp.source_endpoint
            self.hub.cache_endpoint(prefill, endpoint)
        key = peer_key(*prefill)
        try:
            source = self._source = SourceInfo.from_proto(room.source, endpoint)
            aux_buffers, aux_src = aux_from_proto(room.source, endpoint)
            self.hub.agent.add_peer(key, source.metadata)
            self.started = time.monotonic()
            self._state = KvPoll.TRANSFERRING
            if self._aux_slot is not None and aux_src.size:
                self._aux = self.hub.agent.read_slots(key, aux_buffers, aux_src, [self._aux_slot])
            else:
                self._post_kv_locked(key, source)
        except TransferError as exc:
            self._fail_locked(RoomFailure("TRANSFER_FAILED", str(exc)), read_posted=self._aux is not None)

    def _after_aux_locked(self) -> None:
        aux, source = self._aux, self._source
        if aux is None or source is None or self._read_posted or self.prefill is None:
            return
        state = aux.poll()
        if state == "PROC":
            return
        if state == "ERR":
            self._fail_locked(RoomFailure("TRANSFER_FAILED", f"aux READ failed: {aux.error}"))
            return
        self.bytes_read += aux.nbytes
        self._post_kv_locked(peer_key(*self.prefill), source)

    def _post_kv_locked(self, key: str, source: SourceInfo) -> None:
        self._read_posted = True
        self.kv.start(source, key)
        self.bytes_read += sum(b.bytes_per_page for b in self.hub.pool.kv) * source.num_pages

    def abort(self, detail: str = "aborted by SGLang") -> None:
        self.fail(RoomFailure("ROOM_END_CAUSE_DECODE_FAILED", detail))

    def fail(self, failure: RoomFailure) -> None:
        """Ends the room with `failure` unless it already ended."""
        with self._lock:
            if self.failure is None and self._state != KvPoll.SUCCESS:
                self._fail_locked(failure)

    def release_safe(self) -> bool:
        """True once no READ of this room may still write its pages (KV or aux)."""
        with self._lock:
            aux_live = self._aux is not None and self._aux.in_flight
            if aux_live and self._aux is not None:
                self._aux.poll()
                aux_live = self._aux.in_flight
            if not aux_live and self._notify_fail_later:
                self._notify_fail_later = False
                self._send_fail_notif()
            return not aux_live and not self.kv.in_flight()

    def _send_fail_notif(self) -> None:
        if self.prefill is None:
            return
        token = self._source.token if self._source is not None else ""
        try:
            self.hub.agent.send_notif(peer_key(*self.prefill), fail_notif(str(self.room_id), token))
        except TransferError:
            pass  # the source is gone: nothing of it waits for this

    def clear(self) -> None:
        """Forgets the room; a READ still in flight is parked with the hub until it ends."""
        if self._aux is not None and self._aux.in_flight:
            self._aux.release()
        self.release_safe()  # sends a deferred fail notification once the aux READ has ended
        with self._lock:
            if self.kv.in_flight():
                self.hub.park(self.kv)
            else:
                self.kv.clear()
        self.hub.forget_room(self.room_id)

    def _fail_locked(
        self, failure: RoomFailure, *, read_posted: bool | None = None, tell_directory: bool = True
    ) -> None:
        self.failure = failure
        self._state = KvPoll.FAILED
        posted = self._read_posted if read_posted is None else read_posted
        self.kv.abort(str(failure))
        if self._aux is not None and not self._read_posted and self.prefill is not None:
            # The KV READ never started, so no done/fail notification carries this room: say it here,
            # once the aux READ has ended (cancelled if still running), so the source never reuses a
            # slot this process may still be reading.
            aux = self._aux
            if aux.in_flight:
                aux.poll()
            if aux.in_flight and not aux.release():
                self._notify_fail_later = True
            else:
                self._send_fail_notif()
        if tell_directory and self.prefill is not None:
            cause = dpb.ROOM_END_CAUSE_DECODE_FAILED if posted else dpb.ROOM_END_CAUSE_DECODE_DECLINED
            self.hub.submit(
                self.hub.client.abort_room(self.room_id, cause, failure.detail[:1000], *self.hub.peer)
            )
