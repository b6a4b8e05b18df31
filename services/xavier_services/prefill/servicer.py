"""PrefillService: computes a prompt's KV and first token, publishes the pages, unpins them when done.

Page lifetime of one room (invariant I1): pinned by the engine's prefill; published to the directory
(PublishSource opens the room for the router's pair, or adopts the one the decode opened); unpinned when
the decode reports done (NIXL notification) or the room completes (directory), whichever comes first. If
the room ends any other way after publication, a read may still be in flight, so the pages stay *parked*
until the reader reports done/failed or `park_timeout_seconds` passes. A first token that already ends the
request publishes nothing: its pages are freed at once and no room is opened.

A pair handoff (`PrefillRequest.pair_handoff`, HandoffProtocol PAIR) keeps the directory out: the source
goes back in the response, and the pages are unpinned on the reader's NIXL notification (done, failed or
declined), at once on a ReleaseSource that says no decode was called, and otherwise (the router gave up
after calling the decode, or no word within the room lease) once parked as above.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pb
from xavier.v1 import prefill_service_pb2_grpc, types_pb2

from xavier_core.directory import TERMINAL_ROOM_STATES
from xavier_core.engine.api import PrefillResult
from xavier_core.runtime.durations import to_duration
from xavier_core.runtime.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    XavierError,
)
from xavier_core.runtime.identity import require
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer import ReadEnd
from xavier_services.peer.convert import (
    check_prompt,
    check_room_id,
    finish_to_pb,
    prompt_logprobs_pb,
    sampling_from_pb,
    top_pb,
    usage_pb,
)
from xavier_services.peer.host import PeerHost
from xavier_services.peer.metrics import PeerCollector, register_peer_metrics
from xavier_services.peer.sessions import prefill_session

log = get_logger(__name__)
# Statuses after which a PublishSource may still have taken effect (the answer was lost, not a refusal).
_UNSURE = frozenset(
    (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    )
)


def _with_logprobs(resp: pb.PrefillResponse, res: PrefillResult) -> pb.PrefillResponse:
    """Adds the first token's alternatives and the prompt's logprobs, where the request asked."""
    top = top_pb(res.first_top)
    if top is not None:
        resp.first_top_logprobs.CopyFrom(top)
    if res.prompt_logprobs is not None:
        resp.prompt_logprobs.CopyFrom(prompt_logprobs_pb(res.prompt_logprobs))
    return resp


@dataclass
class _Hold:
    room_id: int
    request_id: str
    parked: bool = False
    pages: int = 0
    task: asyncio.Task[None] | None = None
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the prefill stops: every wait of the hold ends at once."""
    released: asyncio.Future[bool] | None = None
    """A pair handoff's ReleaseSource, once it came: whether the router had called the decode."""
    listening: asyncio.Task[Any] | None = None
    """A pair handoff's hold while it waits for its reader's word alone: the router's word and the stop
    cut that wait short (`interrupt`), so no task waits for each of them beside it."""

    def interrupt(self) -> None:
        """Ends the wait for the reader's word, if one runs (ReleaseSource came, or the prefill stops)."""
        if self.listening is not None:
            self.listening.cancel()
            self.listening = None


class PrefillServicer(prefill_service_pb2_grpc.PrefillServiceServicer):  # type: ignore[misc]
    def __init__(self, host: PeerHost) -> None:
        self.host = host
        self._holds: dict[int, _Hold] = {}
        self._no_holds = asyncio.Event()
        self._no_holds.set()
        self._draining = False
        register_peer_metrics(
            PeerCollector(
                "prefill",
                lambda: host.engine_stats_pb(pages_parked=self.pages_parked),
                lambda: len(self._holds),
                host.transfer_stats_pb,
                lambda: host.engine.stats().extra,
            )
        )

    @property
    def pages_parked(self) -> int:
        return sum(h.pages for h in self._holds.values() if h.parked)

    async def Prefill(
        self,
        request: pb.PrefillRequest,
        context: grpc.aio.ServicerContext[pb.PrefillRequest, pb.PrefillResponse],
    ) -> pb.PrefillResponse:
        require(context, "Prefill", roles=("router",))
        host = self.host
        check_room_id(request.room_id)
        if not request.decode_peer_id:
            raise InvalidArgument("decode_peer_id is required", field="decode_peer_id")
        token_ids = list(request.token_ids)
        check_prompt(token_ids, host.engine.max_context, host.vocab_size)
        sampling = sampling_from_pb(request.sampling)
        if self._draining:
            raise Unavailable("the prefill is shutting down", reason="SHUTTING_DOWN")
        if request.room_id in self._holds:
            raise FailedPrecondition(f"room {request.room_id} is already prefilled here", reason="ROOM_BUSY")
        hold = _Hold(request.room_id, f"prefill-{request.room_id}")
        self._holds[request.room_id] = hold
        self._no_holds.clear()
        started = time.perf_counter()
        try:
            res = await host.engine.prefill(
                hold.request_id, token_ids, sampling, cache_salt=request.cache_salt
            )
            hold.pages = len(res.page_ids)
            if hold.aborted.is_set():
                raise Aborted(f"room {request.room_id} aborted during prefill")
        except BaseException:
            # Cancelled by the router, aborted or failed: nothing may stay pinned.
            await asyncio.shield(self._fail(hold, published=False, room=not request.pair_handoff))
            raise
        prefill_s = time.perf_counter() - started
        usage = usage_pb(len(token_ids), res.cached_tokens, res.cached_tokens_store)
        timings = types_pb2.Timings(
            prefill=to_duration(prefill_s), time_to_first_token=to_duration(prefill_s)
        )
        if res.finish is not None:
            # The first token ends the request: no decode will come, so nothing is published.
            host.engine.release_pages(hold.request_id)
            self._drop(hold)
            return _with_logprobs(
                pb.PrefillResponse(
                    first_token=res.first_token,
                    first_logprob=res.first_logprob,
                    first_text=res.text,
                    first_token_source=types_pb2.FIRST_TOKEN_SOURCE_PREFILL,
                    finish_reason=finish_to_pb(res.finish),
                    usage=usage,
                    timings=timings,
                ),
                res,
            )
        decode = (request.decode_peer_id, request.decode_epoch)
        source: dpb.SourceDescriptor | None = None
        if request.pair_handoff:
            # The source goes back with the first token; the router hands it to the decode.
            source = await self._publish_pair(hold, res, len(token_ids), decode)
        else:
            # The first token goes back at once (TTFT = prefill time); publication runs beside it and
            # the decode, which the router starts on this answer, finds the source through BeginTransfer.
            hold.task = asyncio.get_running_loop().create_task(
                self._publish_and_hold(hold, res, len(token_ids), decode)
            )
        digest = b""
        if request.return_kv_digest:
            data = await asyncio.to_thread(host.engine.read_pages, res.page_ids)
            digest = hashlib.sha256(data).digest()
        return _with_logprobs(
            pb.PrefillResponse(
                kv_digest=digest,
                first_token=res.first_token,
                first_logprob=res.first_logprob,
                first_text=res.text,
                first_token_source=types_pb2.FIRST_TOKEN_SOURCE_PREFILL,
                usage=usage,
                timings=timings,
                num_pages=len(res.page_ids),
                source=source,
            ),
            res,
        )

    async def _publish_pair(
        self, hold: _Hold, res: PrefillResult, num_tokens: int, decode: tuple[str, int]
    ) -> dpb.SourceDescriptor:
        """Publishes a pair handoff's source on the port only, and starts the hold that unpins it."""
        host = self.host
        hold.released = asyncio.get_running_loop().create_future()
        try:
            reader = await host.peer_host(decode) if host.port.needs_reader_host else None
            source = await host.port.publish(hold.room_id, res.page_ids, host.fingerprint, reader_host=reader)
        except BaseException:
            await asyncio.shield(self._fail(hold, published=False, room=False))
            raise
        source.num_tokens = num_tokens
        hold.task = asyncio.get_running_loop().create_task(self._hold_pair(hold))
        return source

    async def _hold_pair(self, hold: _Hold) -> None:
        """Unpins a pair handoff's source on its reader's word, or on the router's when no decode was
        called; parks it when the router gave up after calling the decode or no word came in the lease."""
        host = self.host
        assert hold.released is not None
        outcome = ReadEnd.NONE
        if not hold.released.done() and not hold.aborted.is_set():
            task = hold.listening = asyncio.current_task()
            try:
                outcome = await host.port.wait_read_end(hold.room_id, host.config.handoff.room_lease_seconds)
            except asyncio.CancelledError:
                if task is None or task.uncancel() > 0 or hold.listening is task:
                    raise  # cancelled by anything but `interrupt`
                outcome = await host.port.wait_read_end(hold.room_id, 0)  # a word that came meanwhile
            finally:
                hold.listening = None
        if outcome or hold.aborted.is_set() or (hold.released.done() and not hold.released.result()):
            await self._unpin(hold, completed=outcome == ReadEnd.DONE)
            return
        await self._park(hold)

    async def ReleaseSource(
        self,
        request: pb.ReleaseSourceRequest,
        context: grpc.aio.ServicerContext[pb.ReleaseSourceRequest, pb.ReleaseSourceResponse],
    ) -> pb.ReleaseSourceResponse:
        require(context, "ReleaseSource", roles=("router",))
        check_room_id(request.room_id)
        hold = self._holds.get(request.room_id)
        if hold is None:
            return pb.ReleaseSourceResponse(held=False)
        # A hold without `released` is a directory room's, or a prefill still running (the router ends
        # that by cancelling its call): the room's own end unpins those.
        if hold.released is not None and not hold.released.done():
            hold.released.set_result(request.decode_called)
            hold.interrupt()
        return pb.ReleaseSourceResponse(held=True)

    async def PrefillSession(
        self, requests: AsyncIterator[pb.PrefillSessionRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await prefill_session(requests, context, self.Prefill, self.ReleaseSource)

    async def _publish_and_hold(
        self, hold: _Hold, res: PrefillResult, num_tokens: int, decode: tuple[str, int]
    ) -> None:
        host = self.host
        published = False
        try:
            # Whether to stage the room depends on where the decode runs (see KvPort.stages_for).
            reader = await host.peer_host(decode) if host.port.needs_reader_host else None
            source = await host.port.publish(hold.room_id, res.page_ids, host.fingerprint, reader_host=reader)
            source.num_tokens = num_tokens
            published = True
            room = await host.dir.publish_source(
                hold.room_id, (host.peer_id, host.epoch), decode, source, request_id=f"{hold.request_id}-pub"
            )
        except BaseException as err:
            log.info("publication failed", room_id=hold.room_id, error=str(err))
            if published and isinstance(err, XavierError) and err.code not in _UNSURE:
                # The directory answered and refused (e.g. the decode is gone): no room shows this source,
                # so no read can start. Waiting for the room's outcome would wait for a room that never
                # existed (two room leases, then a park timeout).
                published = False
                await asyncio.shield(self.host.port.unpublish(hold.room_id, completed=False))
            await asyncio.shield(self._fail(hold, published))
            return
        if room.state in TERMINAL_ROOM_STATES:
            # The room ended before the source was in it (the router aborted, the decode gave up): no
            # decode saw the source, so no read can run.
            await self._unpin(hold, completed=False)
            return
        await self._hold_until_read(hold)

    async def _fail(self, hold: _Hold, published: bool, room: bool = True) -> None:
        """Ends a failed or cancelled prefill; `room`: the request has a directory room to end."""
        host = self.host
        await host.engine.abort(hold.request_id)
        if room:
            # Before the room exists this leaves a tombstone, so a decode waiting for the source learns
            # now.
            await host.abort_room(
                hold.room_id, dpb.ROOM_END_CAUSE_PREFILL_FAILED, "prefill failed or cancelled"
            )
        if published:
            # The directory may have shown the source to the decode: unpin only once no read can run.
            await self._hold_until_read(hold)
        else:
            host.engine.release_pages(hold.request_id)
            self._drop(hold)

    def _drop(self, hold: _Hold) -> None:
        self._holds.pop(hold.room_id, None)
        if not self._holds:
            self._no_holds.set()

    async def _park(self, hold: _Hold) -> None:
        """Keeps a published room's pages until its reader is done with them or says it never read
        them (NIXL notification, or, in a directory room, its word through the directory), the park
        timeout, or the stop."""
        host = self.host
        hold.parked = True
        timeout = host.config.handoff.park_timeout_seconds
        try:
            if not host.port.read_ended(hold.room_id):
                read_end = asyncio.ensure_future(host.port.wait_read_end(hold.room_id, timeout))
                stop = asyncio.ensure_future(hold.aborted.wait())
                waits: set[asyncio.Future[Any]] = {read_end, stop}
                declined: asyncio.Future[bool] | None = None
                if hold.released is None:  # a directory room's decode may decline through the directory
                    declined = asyncio.ensure_future(host.feed.read_declined(hold.room_id, timeout))
                    waits.add(declined)
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in waits:
                        t.cancel()
                # Each wait answers "" / False when its timeout passed first.
                ended = (read_end.done() and read_end.result()) or (
                    declined is not None and declined.done() and declined.result()
                )
                if not ended and not stop.done():
                    log.warning("parked pages reclaimed after timeout", room_id=hold.room_id)
        finally:
            await self._unpin(hold, completed=False)

    async def _hold_until_read(self, hold: _Hold) -> None:
        """Unpins on the reader's notification or the room's completion; parks on any other ending.

        The room's states come from the peer's room feed (one directory stream for all rooms). A decode
        reads only after BeginTransfer moved the room to TRANSFERRING, and BeginTransfer is refused once
        the room ended; so a room that ended without passing TRANSFERRING has no reader.
        """
        host = self.host
        room_id = hold.room_id
        handoff = host.config.handoff
        notif = asyncio.ensure_future(
            host.port.wait_read_end(room_id, handoff.room_lease_seconds + handoff.park_timeout_seconds)
        )
        watch = asyncio.ensure_future(host.feed.outcome(room_id, handoff.room_lease_seconds * 2))
        stop = asyncio.ensure_future(hold.aborted.wait())
        try:
            done, _ = await asyncio.wait({notif, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
            outcome = notif.result() if notif in done else ""
            if outcome == "done":
                # The read is over: unpin now; release the room only once the decode completed it.
                await self._unpin(hold, completed=True)
                return
            if not watch.done():
                await asyncio.wait({watch, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not watch.done():
                await self._unpin(hold, completed=False)  # the prefill stops (see drain)
                return
            state, may_read = watch.result()
            if state == dpb.ROOM_STATE_COMPLETED:
                await self._unpin(hold, completed=True)
            elif not may_read or (notif.done() and notif.result() == "fail"):
                await self._unpin(hold, completed=False)
            else:
                await self._park(hold)
        finally:
            for t in (notif, watch, stop):
                t.cancel()
            host.feed.forget(room_id)

    async def _unpin(self, hold: _Hold, completed: bool) -> None:
        await self.host.port.unpublish(hold.room_id, completed=completed)
        self.host.engine.release_pages(hold.request_id)
        self._drop(hold)

    async def GetPrefillStats(
        self,
        request: pb.GetPrefillStatsRequest,
        context: grpc.aio.ServicerContext[pb.GetPrefillStatsRequest, pb.GetPrefillStatsResponse],
    ) -> pb.GetPrefillStatsResponse:
        host = self.host
        return pb.GetPrefillStatsResponse(
            engine=host.engine_stats_pb(pages_parked=self.pages_parked),
            rooms_active=len(self._holds),
            transfer=host.transfer_stats_pb(),
            peer=f"{host.peer_id}@{host.epoch}",
        )

    async def drain(self) -> None:
        """On shutdown: refuse new prefills, end every room (SHUTDOWN) and release every page at once.

        Holds stop waiting for their reader. That wait keeps a read in flight from meeting reused pages,
        and from now on nothing reuses a page (no prefill starts; the engine closes next); a read still
        running when the port closes fails on the decode's side, which keeps its own pages until its
        transfer handle ends (I1).
        """
        self._draining = True
        holds = list(self._holds.values())
        for hold in holds:
            hold.aborted.set()
            hold.interrupt()
            await self.host.engine.abort(hold.request_id)
        if not await self.host.end_rooms([h.room_id for h in holds], "prefill shutting down", self._no_holds):
            log.warning("rooms still held at shutdown", rooms=len(self._holds))
