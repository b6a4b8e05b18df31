"""DecodeService: pulls a room's prompt KV into pages reserved up front and streams the answer.

Roles: `decode` serves Decode (P/D); `unified` serves GenerateUnified (colocated). The router calls
Decode with the first token the prefill returned; destination pages are reserved at once and BeginTransfer
opens the room for the pair (or adopts the one the prefill's publication opened), so the read starts the
moment the room turns SOURCE_READY. The prefill's transfer endpoint comes from the directory once per
prefill epoch and is cached here. A read that may still be writing into the pages keeps them reserved until
the NIXL handle is no longer in progress (invariant I1); only then are they returned to the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
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
)
from xavier_core.runtime.identity import require
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer import peer_key
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
        self._quiet = asyncio.Event()  # set while nothing is live
        self._quiet.set()
        self._draining = False
        # (prefill peer id, epoch) -> its transfer endpoint, fixed for the epoch (oldest first).
        self._endpoints: dict[tuple[str, int], types_pb2.TransferEndpoint] = {}
        # A pair handoff's prefills (no BeginTransfer brings their endpoint): the directory's peer list.
        self._prefills = PeerCache(
            host.membership, types_pb2.ROLE_PREFILL, host.fingerprint, limit=_ENDPOINT_CACHE
        )
        register_peer_metrics(
            PeerCollector(
                "decode" if host.role == types_pb2.ROLE_DECODE else "unified",
                lambda: host.engine_stats_pb(pages_parked=0),
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
            await asyncio.shield(
                self._finish(rid, request.room_id, completed, read_posted=pulling, room=not pair)
            )

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
        rid = request.request_id or f"unified-{id(request)}-{time.monotonic_ns()}"
        if rid in self._live:
            raise FailedPrecondition(f"request {rid} is already running here", reason="REQUEST_BUSY")
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

    async def GetDecodeStats(
        self,
        request: pb.GetDecodeStatsRequest,
        context: grpc.aio.ServicerContext[pb.GetDecodeStatsRequest, pb.GetDecodeStatsResponse],
    ) -> pb.GetDecodeStatsResponse:
        host = self.host
        return pb.GetDecodeStatsResponse(
            engine=host.engine_stats_pb(pages_parked=0),
            rooms_active=self._rooms_active,
            transfer=host.transfer_stats_pb(),
            peer=f"{host.peer_id}@{host.epoch}",
            role=host.role,
        )

    @property
    def _rooms_active(self) -> int:
        return sum(1 for room_id, _ in self._live.values() if room_id)

    def _enter(self, rid: str, room_id: int, request_id: str) -> None:
        self._live[rid] = (room_id, request_id)
        self._quiet.clear()

    def _leave(self, rid: str) -> None:
        self._live.pop(rid, None)
        if not self._live:
            self._quiet.set()

    def _refuse_when_draining(self) -> None:
        if self._draining:
            raise Unavailable("the decode is shutting down", reason="SHUTTING_DOWN")

    async def drain(self) -> None:
        """On shutdown: refuse new requests, end every live request (streams end FINISH_REASON_ABORT)
        and room (SHUTDOWN: a wait for its source ends now), and wait until each told the directory how
        it ended, before the peer closes its channel."""
        self._draining = True
        live = list(self._live.items())
        for rid, _ in live:
            await self.host.engine.abort(rid)
        rooms = [room for _, (room, _) in live if room]
        if not await self.host.end_rooms(rooms, "decode shutting down", self._quiet):
            log.warning("requests still live at shutdown", requests=len(self._live))
