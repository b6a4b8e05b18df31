"""DecodeService: pulls a room's prompt KV into pages reserved up front and streams the answer.

Roles: `decode` serves Decode (P/D); `unified` serves GenerateUnified (colocated). The router calls
Decode with the first token the prefill returned; destination pages are reserved at once and BeginTransfer
opens the room for the pair (or adopts the one the prefill's publication opened), so the read starts the
moment the room turns SOURCE_READY. The prefill's transfer endpoint comes from the directory once per
prefill epoch and is cached here. A read that may still be writing into the pages keeps them reserved until
the NIXL handle is no longer in progress (invariant I1); only then are they returned to the engine.

A unified replica with `handoff.share_prefixes` also serves SharePrefix: it pins the pages of a prefix
still in its prefix cache (from the reader's `first_page` on) and publishes them on its port as a source
for one reader, as a prefill does for a pair handoff, and unpins them on the reader's NIXL notification;
with no word within the room lease it parks them (a read may be running) until the word comes or the
park timeout passes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc
from xavier.v1 import decode_service_pb2 as pb
from xavier.v1 import decode_service_pb2_grpc, types_pb2
from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.directory import TERMINAL_ROOM_STATES
from xavier_core.engine.api import AbortEvent, StreamEvent, TokenEvent
from xavier_core.runtime.durations import to_duration
from xavier_core.runtime.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    LayoutMismatch,
    LeaseExpired,
    Unavailable,
    XavierError,
)
from xavier_core.runtime.identity import require
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer import peer_key
from xavier_core.transfer.port.kv_port import ReadEnd
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
from xavier_services.peer.membership import PeerCache
from xavier_services.peer.metrics import PeerCollector, register_peer_metrics
from xavier_services.peer.sessions import decode_session

log = get_logger(__name__)
# Room endings that mean a peer went away (retry elsewhere), not that the request was given up.
_PEER_CAUSES = frozenset((dpb.ROOM_END_CAUSE_PEER_LOST, dpb.ROOM_END_CAUSE_SHUTDOWN))
_ENDPOINT_CACHE = 256
"""Prefill endpoints (one per peer epoch) cached; a mesh has far fewer prefill peers than this."""


@dataclass
class _Share:
    """A prefix published for one reader (SharePrefix); its pages are pinned for `owner` meanwhile."""

    room_id: int
    pages: int = 0
    parked: bool = False
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the replica stops: the hold ends at once."""

    @property
    def owner(self) -> str:
        """The engine's pin owner: the room id is unique among live shares, so this is too."""
        return f"share-prefix-{self.room_id}"


async def _or_stop(wait: Awaitable[ReadEnd], stop: asyncio.Event) -> ReadEnd:
    """The read's end `wait` answers, or `ReadEnd.NONE` when `stop` comes first."""
    read_end = asyncio.ensure_future(wait)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({read_end, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        read_end.cancel()
        stopped.cancel()
    return read_end.result() if read_end.done() and not read_end.cancelled() else ReadEnd.NONE


def _delta(ev: StreamEvent) -> pb.TokenDelta:
    if isinstance(ev, AbortEvent):  # ends an aborted stream; it carries no token
        return pb.TokenDelta()
    top = top_pb(ev.top)
    return pb.TokenDelta(
        token_ids=[ev.token_id],
        logprobs=[ev.logprob],
        text=ev.text,
        top_logprobs=[top] if top is not None else [],
    )


class DecodeServicer(decode_service_pb2_grpc.DecodeServiceServicer):  # type: ignore[misc]
    def __init__(self, host: PeerHost) -> None:
        self.host = host
        # engine request id -> (room id, 0 for unified requests; client request id)
        self._live: dict[str, tuple[int, str]] = {}
        self._quiet = asyncio.Event()  # set while nothing is live: no request, no share
        self._quiet.set()
        self._draining = False
        # (prefill peer id, epoch) -> its transfer endpoint, fixed for the epoch (oldest first).
        self._endpoints: dict[tuple[str, int], types_pb2.TransferEndpoint] = {}
        # A pair handoff's prefills (no BeginTransfer brings their endpoint): the directory's peer list.
        self._prefills = PeerCache(
            host.membership, types_pb2.ROLE_PREFILL, host.fingerprint, limit=_ENDPOINT_CACHE
        )
        # SharePrefix: live shares by room id, and their readers' registrations (for the reader's host).
        self._shares: dict[int, _Share] = {}
        self._readers = PeerCache(
            host.membership, types_pb2.ROLE_UNSPECIFIED, host.fingerprint, limit=_ENDPOINT_CACHE
        )
        register_peer_metrics(
            PeerCollector(
                "decode" if host.role == types_pb2.ROLE_DECODE else "unified",
                lambda: host.engine_stats_pb(pages_parked=self._pages_parked),
                lambda: self._rooms_active,
                host.transfer_stats_pb,
                lambda: host.engine.stats().extra,
            )
        )

    async def Decode(
        self,
        request: pb.DecodeRequest,
        context: grpc.aio.ServicerContext[pb.DecodeRequest, pb.DecodeResponse],
    ) -> AsyncIterator[pb.DecodeResponse]:
        require(context, "Decode", roles=("router",))
        host = self.host
        if host.role != types_pb2.ROLE_DECODE:
            raise FailedPrecondition("this replica is unified: use GenerateUnified", reason="WRONG_ROLE")
        check_room_id(request.room_id)
        if not request.prefill_peer_id:
            raise InvalidArgument("prefill_peer_id is required", field="prefill_peer_id")
        if request.first_token_source == types_pb2.FIRST_TOKEN_SOURCE_DECODE:
            # This engine continues after the prefill's first token; it cannot sample the first itself.
            raise InvalidArgument(
                "this decode needs the prefill's first token (first_token_source PREFILL)",
                field="first_token_source",
            )
        token_ids = list(request.token_ids)
        check_prompt(token_ids, host.engine.max_context, host.vocab_size)
        sampling = sampling_from_pb(request.sampling)
        rid = f"decode-{request.room_id}"
        if rid in self._live:
            raise FailedPrecondition(f"room {request.room_id} is already decoding here", reason="ROOM_BUSY")
        self._refuse_when_draining()
        source_key = (request.prefill_peer_id, request.prefill_epoch)
        pair = request.HasField("source")  # a pair handoff: no directory room
        started = time.perf_counter()
        endpoint: types_pb2.TransferEndpoint | None = None
        if pair:
            endpoint = await self._prefill_endpoint(source_key)
        try:
            pages = host.engine.reserve_pages(rid, len(token_ids))
        except BaseException:
            if endpoint is not None:  # no read will come: the prefill unpins now
                await asyncio.shield(
                    host.port.decline(
                        request.room_id, request.source.read_token, endpoint, peer_key(*source_key)
                    )
                )
            raise
        self._enter(rid, request.room_id, request.request_id)
        completed = False
        src = request.source  # a pair's source; a directory room's comes with BeginTransfer
        pulling = False
        complete: asyncio.Future[object] | None = None
        try:
            if not pair:
                room, endpoint = await self._begin(request.room_id, source_key, rid)
                src = room.source
            if src.contract_fingerprint != host.fingerprint:
                raise LayoutMismatch(
                    "source pages were computed under another KV layout",
                    fields="contract_fingerprint",
                    source=src.contract_fingerprint,
                    decode=host.fingerprint,
                )
            handoff = host.config.handoff
            pulling = True  # from here the pull tells the source how the read ended
            nbytes, transfer_s = await host.port.pull(
                request.room_id,
                src,
                endpoint,
                peer_key(*source_key),
                pages,
                handoff.transfer_timeout_seconds,
                handoff.park_timeout_seconds,
            )
            self._refuse_when_draining()  # the pages came as the decode stops: its stream would not end
            if pair:  # the read's end already told the prefill: nothing to complete
                complete = asyncio.get_running_loop().create_future()
                complete.set_result(None)
            else:
                # The room's work is done once the pages are here: completing it ends it, so the decode
                # keeps nothing in the directory while it streams the answer. The engine's first step
                # runs while the directory answers; no message goes out before it did.
                complete = asyncio.ensure_future(
                    host.dir.complete_room(
                        request.room_id,
                        host.peer_id,
                        host.epoch,
                        bytes_transferred=nbytes,
                        transfer_seconds=transfer_s,
                        request_id=f"{rid}-complete",
                    )
                )
            digest = b""
            if request.return_kv_digest:
                data = await asyncio.to_thread(host.engine.read_pages, pages)
                digest = hashlib.sha256(data).digest()
            events = host.engine.decode_from_pages(
                rid, token_ids, request.first_token, request.first_logprob, sampling, request.cache_salt
            )
            async for msg in self._stream(events, len(token_ids), started, transfer_s, complete):
                completed = True
                if digest:
                    msg.kv_digest, digest = digest, b""
                yield msg
        finally:
            if complete is not None:
                if not complete.done():
                    complete.cancel()
                elif not complete.cancelled() and complete.exception() is None:
                    completed = True
            if endpoint is not None and not pulling:  # the room began (or came with the request)
                decline = host.port.decline(request.room_id, src.read_token, endpoint, peer_key(*source_key))
                await asyncio.shield(decline)
            finish = self._finish(rid, request.room_id, completed, read_posted=pulling, room=not pair)
            if pair:
                # Nothing in a pair's finish waits (the engine's abort returns at once, and no room is
                # told), so no cancel can cut it short: a shield's task would cost a loop turn for nothing.
                await finish
            else:
                await asyncio.shield(finish)

    async def _prefill_endpoint(self, source: tuple[str, int]) -> types_pb2.TransferEndpoint:
        """A pair handoff's prefill endpoint: from the directory's peer list once per prefill epoch."""
        found = await self._prefills.find(source)
        if found is None:
            raise Unavailable(
                f"prefill {source[0]} epoch {source[1]} is not in the directory", reason="PEER_UNAVAILABLE"
            )
        return found.endpoint

    async def _begin(
        self, room_id: int, source: tuple[str, int], rid: str
    ) -> tuple[dpb.Room, types_pb2.TransferEndpoint]:
        """Opens or adopts the room, waits in the directory for the source, then moves the room to
        TRANSFERRING, in one call; returns the room and the source's endpoint (cached per epoch)."""
        host = self.host
        lease = host.config.handoff.room_lease_seconds
        cached = self._endpoints.get(source)
        resp = await host.dir.begin_transfer(
            room_id,
            source,
            (host.peer_id, host.epoch),
            request_id=f"{rid}-begin",
            wait_for_source=lease,
            source_endpoint_cached=cached is not None,
        )
        room = resp.room
        if room.state in TERMINAL_ROOM_STATES:
            detail = room.end_detail or dpb.RoomEndCause.Name(room.end_cause)
            if room.end_cause == dpb.ROOM_END_CAUSE_LEASE_EXPIRED:
                raise LeaseExpired(
                    f"room {room_id} expired before its source was ready", room_id=str(room_id)
                )
            if room.end_cause in _PEER_CAUSES:
                raise Unavailable(f"room {room_id} ended: {detail}", reason="PEER_UNAVAILABLE")
            raise Aborted(f"room {room_id} ended: {detail}", room_id=str(room_id))
        if cached is None:
            cached = self._endpoints[source] = resp.source_endpoint
            while len(self._endpoints) > _ENDPOINT_CACHE:
                del self._endpoints[next(iter(self._endpoints))]
        return room, cached

    async def _finish(self, rid: str, room_id: int, completed: bool, read_posted: bool, room: bool) -> None:
        """Frees the request's pages; `room`: it has a directory room to end (else its read's end, or
        its decline, told the prefill)."""
        host = self.host
        try:
            stuck = host.port.take_stuck(room_id) if read_posted else None
            if stuck is not None:  # the read may still land: out of use until it has ended
                host.engine.quarantine_pages(rid, until=stuck)
            await host.engine.abort(rid)
            host.engine.release_pages(rid)
            if room and not completed:
                # Without a posted read this decode never touched the source: say so, so the prefill
                # unpins at once even if this decode's BeginTransfer was applied but its answer never came.
                if read_posted:
                    await host.abort_room(
                        room_id, dpb.ROOM_END_CAUSE_DECODE_FAILED, "decode failed or cancelled"
                    )
                else:
                    await host.abort_room(room_id, dpb.ROOM_END_CAUSE_DECODE_DECLINED, "decode never read")
        finally:
            self._leave(rid)  # only now: the drain waits for this word to reach the directory

    async def _stream(
        self,
        events: AsyncIterator[StreamEvent],
        prompt_tokens: int,
        started: float,
        transfer_s: float,
        before_first: asyncio.Future[object],
    ) -> AsyncIterator[pb.DecodeResponse]:
        n = 0
        async for ev in events:
            n += 1
            if n == 1 and ev.finish is None:
                continue  # the first token: the router already sent it (its text came from the prefill)
            msg = pb.DecodeResponse(delta=_delta(ev) if n > 1 else pb.TokenDelta())
            if ev.finish is not None:
                msg.finish_reason = finish_to_pb(ev.finish)
                msg.usage.CopyFrom(types_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=n))
                msg.timings.CopyFrom(
                    types_pb2.Timings(
                        transfer=to_duration(transfer_s), total=to_duration(time.perf_counter() - started)
                    )
                )
            await before_first  # raises if the room could not be completed (done at once after the first)
            yield msg

    async def DecodeSession(
        self, requests: AsyncIterator[pb.DecodeSessionRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await decode_session(requests, context, self.Decode)

    async def GenerateUnified(
        self,
        request: pb.GenerateUnifiedRequest,
        context: grpc.aio.ServicerContext[pb.GenerateUnifiedRequest, pb.GenerateUnifiedResponse],
    ) -> AsyncIterator[pb.GenerateUnifiedResponse]:
        require(context, "GenerateUnified", roles=("router",))
        host = self.host
        if host.role != types_pb2.ROLE_UNIFIED:
            raise FailedPrecondition("this replica is a P/D decode: use Decode", reason="WRONG_ROLE")
        token_ids = list(request.token_ids)
        check_prompt(token_ids, host.engine.max_context, host.vocab_size)
        sampling = sampling_from_pb(request.sampling)
        # The engine's id: a client's id under a prefix of its own, so that no client id can be a share's
        # pin owner (`_Share.owner`) or another engine id of this replica.
        rid = (
            f"unified:{request.request_id}"
            if request.request_id
            else f"unified-{id(request)}-{time.monotonic_ns()}"
        )
        if rid in self._live:
            # Only a client's id can be running already (a made-up one is new): name it as the client gave it.
            raise FailedPrecondition(
                f"request {request.request_id} is already running here", reason="REQUEST_BUSY"
            )
        self._refuse_when_draining()
        self._enter(rid, 0, request.request_id)
        started = time.perf_counter()
        first_at: float | None = None
        n = cached = cached_store = 0
        try:
            async for ev in host.engine.generate(rid, token_ids, sampling, cache_salt=request.cache_salt):
                n += 1
                if first_at is None:
                    first_at = time.perf_counter() - started
                    if isinstance(ev, TokenEvent):
                        cached, cached_store = ev.cached_tokens, ev.cached_tokens_store
                msg = pb.GenerateUnifiedResponse(delta=_delta(ev))
                if isinstance(ev, TokenEvent) and ev.prompt is not None:
                    msg.prompt_logprobs.CopyFrom(prompt_logprobs_pb(ev.prompt))
                if ev.finish is not None:
                    msg.finish_reason = finish_to_pb(ev.finish)
                    msg.usage.CopyFrom(usage_pb(len(token_ids), cached, cached_store, completion_tokens=n))
                    msg.timings.CopyFrom(
                        types_pb2.Timings(
                            time_to_first_token=to_duration(first_at),
                            total=to_duration(time.perf_counter() - started),
                        )
                    )
                yield msg
        finally:
            self._leave(rid)
            await asyncio.shield(host.engine.abort(rid))

    async def SharePrefix(
        self,
        request: pb.SharePrefixRequest,
        context: grpc.aio.ServicerContext[pb.SharePrefixRequest, pb.SharePrefixResponse],
    ) -> pb.SharePrefixResponse:
        require(context, "SharePrefix", roles=("unified", "prefill"))
        host = self.host
        if host.role != types_pb2.ROLE_UNIFIED or host.kv is None:
            raise FailedPrecondition(
                "this replica does not share its prefixes (a unified replica with handoff.share_prefixes)",
                reason="SHARING_OFF",
            )
        port, page_size = host.kv, host.engine.page_size
        check_room_id(request.room_id)
        token_ids = list(request.token_ids)
        check_prompt(token_ids, host.engine.max_context, host.vocab_size)
        if len(token_ids) % page_size:
            raise InvalidArgument(
                f"token_ids must be whole pages of {page_size} tokens, got {len(token_ids)}",
                field="token_ids",
            )
        if request.first_page >= len(token_ids) // page_size:
            raise InvalidArgument(
                f"first_page {request.first_page} is not one of the prefix's {len(token_ids) // page_size} "
                "pages",
                field="first_page",
            )
        if not request.reader_peer_id:
            raise InvalidArgument("reader_peer_id is required", field="reader_peer_id")
        self._refuse_when_draining()
        if request.room_id in self._shares:
            raise FailedPrecondition(f"room {request.room_id} is already shared here", reason="ROOM_BUSY")
        share = _Share(request.room_id)
        pages = host.engine.pin_prefix(share.owner, token_ids, request.cache_salt, request.first_page)
        if not pages:
            return pb.SharePrefixResponse(pages=0)
        share.pages = len(pages)
        self._shares[share.room_id] = share
        self._quiet.clear()
        try:
            reader = (request.reader_peer_id, request.reader_epoch)
            where = await self._reader_host(reader) if port.needs_reader_host else None
            source = await port.publish(share.room_id, pages, host.fingerprint, reader_host=where)
        except BaseException:
            host.engine.release_pages(share.owner)  # nothing was published: no read can come
            self._drop_share(share)
            raise
        source.num_tokens = len(pages) * page_size
        share.task = asyncio.get_running_loop().create_task(self._hold_share(share))
        return pb.SharePrefixResponse(pages=len(pages), source=source)

    async def _reader_host(self, reader: tuple[str, int]) -> str | None:
        """The host id of a reader's endpoint, which decides whether a VRAM source stages the pages; None
        when the directory does not list it or cannot say (the pages are staged: any reader reads them)."""
        try:
            found = await self._readers.find(reader)
        except XavierError:
            return None
        return found.endpoint.host_id if found is not None else None

    async def _hold_share(self, share: _Share) -> None:
        """Unpins a share on its reader's word (done, failed or declined); with no word within the room
        lease a read may still run, so the pages are parked until the word or the park timeout; the
        replica's stop ends the hold at once."""
        port, handoff = self.host.port, self.host.config.handoff
        outcome = ReadEnd.NONE
        try:
            outcome = await _or_stop(
                port.wait_read_end(share.room_id, handoff.room_lease_seconds), share.stop
            )
            if not outcome and not share.stop.is_set():
                share.parked = True
                wait = port.wait_read_end(share.room_id, handoff.park_timeout_seconds)
                outcome = await _or_stop(wait, share.stop)
                if not outcome and not share.stop.is_set():
                    log.warning("parked shared pages reclaimed after timeout", room_id=share.room_id)
        finally:
            try:
                await asyncio.shield(port.unpublish(share.room_id, completed=outcome == ReadEnd.DONE))
            finally:
                self.host.engine.release_pages(share.owner)
                self._drop_share(share)

    def _drop_share(self, share: _Share) -> None:
        self._shares.pop(share.room_id, None)
        if not self._live and not self._shares:
            self._quiet.set()

    async def GetDecodeStats(
        self,
        request: pb.GetDecodeStatsRequest,
        context: grpc.aio.ServicerContext[pb.GetDecodeStatsRequest, pb.GetDecodeStatsResponse],
    ) -> pb.GetDecodeStatsResponse:
        host = self.host
        return pb.GetDecodeStatsResponse(
            engine=host.engine_stats_pb(pages_parked=self._pages_parked),
            rooms_active=self._rooms_active,
            transfer=host.transfer_stats_pb(),
            peer=f"{host.peer_id}@{host.epoch}",
            role=host.role,
        )

    @property
    def _rooms_active(self) -> int:
        return sum(1 for room_id, _ in self._live.values() if room_id) + len(self._shares)

    @property
    def _pages_parked(self) -> int:
        return sum(s.pages for s in self._shares.values() if s.parked)

    def _enter(self, rid: str, room_id: int, request_id: str) -> None:
        self._live[rid] = (room_id, request_id)
        self._quiet.clear()

    def _leave(self, rid: str) -> None:
        self._live.pop(rid, None)
        if not self._live and not self._shares:
            self._quiet.set()

    def _refuse_when_draining(self) -> None:
        if self._draining:
            raise Unavailable("the decode is shutting down", reason="SHUTTING_DOWN")

    async def drain(self) -> None:
        """On shutdown: refuse new requests, end every live request (streams end FINISH_REASON_ABORT)
        and room (SHUTDOWN: a wait for its source ends now), and wait until each told the directory how
        it ended, before the peer closes its channel. Shares end at once, as a prefill's holds do: from
        now on nothing reuses their pages (the engine closes next), and a read still running when the
        port closes fails on the reader's side."""
        self._draining = True
        for share in self._shares.values():
            share.stop.set()
        live = list(self._live.items())
        for rid, _ in live:
            await self.host.engine.abort(rid)
        rooms = [room for _, (room, _) in live if room]
        if not await self.host.end_rooms(rooms, "decode shutting down", self._quiet):
            log.warning("requests still live at shutdown", requests=len(self._live))
