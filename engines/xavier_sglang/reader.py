"""The decode side of one room, as SGLang's receiver polls it (the states are described in `rooms`)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.directory.client import TERMINAL_ROOM_STATES
from xavier_core.transfer.aux_slots import aux_from_proto
from xavier_core.transfer.errors import TransferError
from xavier_core.transfer.kv_transfer import KvPoll, KvReceiver
from xavier_core.transfer.peers import peer_key
from xavier_core.transfer.source import SourceInfo
from xavier_core.transfer.xfer import Transfer

from .hub import Hub
from .rooms import RoomFailure, _ended, _rpc_failure
from .trace import RoomTrace

__all__ = ["ReaderRoom"]

# Failures that say the named prefill epoch is gone: PEER_NOT_FOUND (its peer id left the directory, as a
# restarted process registers under a new id), STALE_EPOCH (it registered again), PEER_UNAVAILABLE (the
# directory has no endpoint for it) and the room's PEER_LOST.
_PREFILL_GONE = frozenset(("PEER_NOT_FOUND", "STALE_EPOCH", "PEER_UNAVAILABLE", "ROOM_END_CAUSE_PEER_LOST"))


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
        # The prefill epoch's endpoint as cached when BeginTransfer was sent (None: the answer carries it).
        self._endpoint: types_pb2.TransferEndpoint | None = None
        self._complete: concurrent.futures.Future[dpb.Room] | None = None
        self._read_posted = False  # a READ of the source (aux slot or pages) was posted
        self.bytes_read = 0
        self.started: float | None = None
        self.finished: float | None = None
        self.trace = RoomTrace("decode", room_id)

    def init(self, prefill: tuple[str, int] | None) -> None:
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
            if self.failure is not None or self.prefill is None:
                return
            try:
                self.kv.init()
                self.kv.send_metadata(pages)
            except TransferError as exc:  # malformed page ids
                self._fail_locked(RoomFailure("INVALID_ARGUMENT", str(exc)), read_posted=False)
                return
            self._aux_slot = aux_slot
            self.trace.mark("metadata")
            # Read once: the cache may drop this entry before the answer comes, and an answer to a call
            # that said "cached" carries no endpoint.
            self._endpoint = self.hub.endpoint(self.prefill)
            self._begin = self.hub.submit(
                self.hub.client.begin_transfer(
                    self.room_id,
                    self.prefill,
                    self.hub.peer,
                    request_id=f"sgl-{self.room_id}-begin",
                    wait_for_source=self.hub.settings.waiting_timeout_s,
                    source_endpoint_cached=self._endpoint is not None,
                )
            )

    def poll(self) -> KvPoll:
        with self._lock:
            self.trace.polls += 1
            if self.failure is not None or self._state == KvPoll.SUCCESS:
                return self._state
            if self._begin is not None and self.started is None and self._begin.done():
                self.trace.mark("begin_answered")
                if self.prefill is not None:
                    self._start_locked(self._begin, self.prefill)
            if self._read_posted and self._complete is None and self.failure is None:
                state = self.kv.poll()
                if state == KvPoll.FAILED:
                    self._fail_locked(RoomFailure("TRANSFER_FAILED", self.kv.error or "READ failed"))
                elif state == KvPoll.SUCCESS:
                    self.trace.mark("read_done")
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
                    self.trace.mark("success")
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
        endpoint = self._endpoint
        if endpoint is None:
            endpoint = resp.source_endpoint
            if resp.HasField("source_endpoint"):
                self.hub.cache_endpoint(prefill, endpoint)
        key = peer_key(*prefill)
        try:
            source = SourceInfo.from_proto(room.source, endpoint)
            aux_buffers, aux_src = aux_from_proto(room.source, endpoint)
        except TransferError as exc:
            self._fail_locked(RoomFailure("TRANSFER_FAILED", str(exc)), read_posted=False)
            return
        lead: Callable[[], Transfer] | None = None
        self.bytes_read = self.hub.page_bytes * source.num_pages
        if self._aux_slot is not None and aux_src.size:
            # The aux slot (first token, metadata) lands before the pages: see `KvReceiver.start`.
            lead = functools.partial(self.hub.agent.read_slots, key, aux_buffers, aux_src, [self._aux_slot])
            self.bytes_read += sum(b.bytes_per_page for b in aux_buffers)
        self.started = time.monotonic()
        self._state = KvPoll.TRANSFERRING
        self.kv.start(source, key, lead=lead)
        if self.kv.poll() == KvPoll.FAILED:  # refused before anything was posted, or already ended
            self._fail_locked(
                RoomFailure("TRANSFER_FAILED", self.kv.error or "READ failed"), read_posted=False
            )
            return
        self._read_posted = True
        self.trace.mark("read_posted")

    @property
    def prefill_gone(self) -> bool:
        """True when the room failed because the prefill epoch it named is no longer registered (it
        stopped, restarted as a new peer, or registered again with a new epoch): a request for the same
        bootstrap address must look the prefill up again."""
        return self.failure is not None and self.failure.code in _PREFILL_GONE

    def abort(self, detail: str = "aborted by SGLang") -> None:
        self.fail(RoomFailure("ROOM_END_CAUSE_DECODE_FAILED", detail))

    def fail(self, failure: RoomFailure) -> None:
        """Ends the room with `failure` unless it already ended."""
        with self._lock:
            if self.failure is None and self._state != KvPoll.SUCCESS:
                self._fail_locked(failure)

    def release_safe(self) -> bool:
        """True once no READ of this room may still write its pages (KV or aux)."""
        return not self.kv.in_flight()

    def clear(self) -> None:
        """Forgets the room; a READ still in flight is parked with the hub until it ends."""
        with self._lock:
            self.trace.write("success" if self._state == KvPoll.SUCCESS else "failed")
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
        # Tells the source once no READ of ours can touch its pages or slot any more (KvReceiver).
        self.kv.abort(str(failure))
        if tell_directory and self.prefill is not None:
            cause = dpb.ROOM_END_CAUSE_DECODE_FAILED if posted else dpb.ROOM_END_CAUSE_DECODE_DECLINED
            self.hub.submit(
                self.hub.client.abort_room(self.room_id, cause, failure.detail[:1000], *self.hub.peer)
            )
