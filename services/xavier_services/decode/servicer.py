"""DecodeService: pulls a room's prompt KV into pages reserved up front and streams the answer.

Roles: `decode` serves Decode (P/D); `unified` serves GenerateUnified (colocated). Destination pages are
reserved before the source exists (while the prefill runs), so the read starts the moment the room turns
SOURCE_READY. A read that may still be writing into the pages keeps them reserved until the NIXL handle is
no longer in progress (invariant I1); only then are they returned to the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import grpc
from xavier.v1 import decode_service_pb2 as pb
from xavier.v1 import decode_service_pb2_grpc, types_pb2
from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.directory import TERMINAL_ROOM_STATES
from xavier_core.engine.api import AbortEvent, StreamEvent
from xavier_core.runtime.durations import to_duration
from xavier_core.runtime.errors import (
    Aborted,
    FailedPrecondition,
    LayoutMismatch,
    LeaseExpired,
    Unavailable,
)
from xavier_core.transfer.peers import peer_key
from xavier_services.peer.convert import check_prompt, check_room_id, finish_to_pb, sampling_from_pb
from xavier_services.peer.host import PeerHost
from xavier_services.peer.metrics import PeerCollector, register_peer_metrics


def _delta(ev: StreamEvent) -> pb.TokenDelta:
    if isinstance(ev, AbortEvent):  # ends an aborted stream; it carries no token
        return pb.TokenDelta()
    return pb.TokenDelta(token_ids=[ev.token_id], logprobs=[ev.logprob], text=ev.text)


class DecodeServicer(decode_service_pb2_grpc.DecodeServiceServicer):
    def __init__(self, host: PeerHost) -> None:
        self.host = host
        # engine request id -> (room id, 0 for unified requests; client request id)
        self._live: dict[str, tuple[int, str]] = {}
        register_peer_metrics(
            PeerCollector(
                "decode" if host.role == types_pb2.ROLE_DECODE else "unified",
                lambda: host.engine_stats_pb(pages_parked=0),
                lambda: self._rooms_active,
                lambda: host.kv.totals.to_pb() if host.kv is not None else types_pb2.TransferStats(),
            )
        )

    async def Decode(
        self,
        request: pb.DecodeRequest,
        context: grpc.aio.ServicerContext[pb.DecodeRequest, pb.DecodeResponse],
    ) -> AsyncIterator[pb.DecodeResponse]:
        host = self.host
        if host.role != types_pb2.ROLE_DECODE:
            raise FailedPrecondition("this replica is unified: use GenerateUnified", reason="WRONG_ROLE")
        check_room_id(request.room_id)
        token_ids = list(request.token_ids)
        check_prompt(token_ids, host.engine.max_context, host.vocab_size)
        sampling = sampling_from_pb(request.sampling)
        rid = f"decode-{request.room_id}"
        if rid in self._live:
            raise FailedPrecondition(f"room {request.room_id} is already decoding here", reason="ROOM_BUSY")
        started = time.perf_counter()
        pages = host.engine.reserve_pages(rid, len(token_ids))
        self._live[rid] = (request.room_id, request.request_id)
        completed = False
        begun: dpb.Room | None = None  # the room, once this decode moved it to TRANSFERRING
        pulling = False
        try:
            room = begun = await self._begin(request.room_id, rid)
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
            nbytes, transfer_s = await host.kv.pull(
                request.room_id,
                src,
                peer_key(room.prefill_peer_id, room.prefill_epoch),
                pages,
                handoff.transfer_timeout_seconds,
                handoff.park_timeout_seconds,
            )
            # The room's work is done once the pages are here: completing it releases it as well, so the
            # decode neither renews nor releases it while it streams the answer.
            await host.dir.complete_room(
                request.room_id,
                host.peer_id,
                host.epoch,
                bytes_transferred=nbytes,
                transfer_seconds=transfer_s,
                request_id=f"{rid}-complete",
                release=True,
            )
            completed = True
            digest = b""
            if request.return_kv_digest:
                data = await asyncio.to_thread(host.engine.read_pages, pages)
                digest = hashlib.sha256(data).digest()
            events = host.engine.decode_from_pages(
                rid, token_ids, src.first_token, src.first_logprob, sampling
            )
            async for msg in self._stream(events, len(token_ids), started, transfer_s):
                if digest:
                    msg.kv_digest, digest = digest, b""
                yield msg
        finally:
            if begun is not None and not pulling:
                key = peer_key(begun.prefill_peer_id, begun.prefill_epoch)
                decline = host.kv.decline(request.room_id, begun.source, key)
                await asyncio.shield(decline)
            await asyncio.shield(self._finish(rid, request.room_id, completed, read_posted=pulling))

    async def _begin(self, room_id: int, rid: str) -> dpb.Room:
        """Waits in the directory for the source, then moves the room to TRANSFERRING, in one call."""
        host = self.host
        lease = host.config.handoff.room_lease_seconds
        room = await host.dir.begin_transfer(
            room_id, host.peer_id, host.epoch, request_id=f"{rid}-begin", wait_for_source=lease
        )
        if room.state == dpb.ROOM_STATE_EXPIRED:
            raise LeaseExpired(f"room {room_id} expired before its source was ready", room_id=str(room_id))
        if room.state in TERMINAL_ROOM_STATES and room.end_reason.startswith("peer "):
            raise Unavailable(f"room {room_id} ended: {room.end_reason}", reason="PEER_UNAVAILABLE")
        if room.state in TERMINAL_ROOM_STATES:
            raise Aborted(f"room {room_id} ended: {room.end_reason or 'aborted'}", room_id=str(room_id))
        return room

    async def _finish(self, rid: str, room_id: int, completed: bool, read_posted: bool) -> None:
        host = self.host
        self._live.pop(rid, None)
        await host.engine.abort(rid)
        host.engine.release_pages(rid)
        if not completed:
            # Without a posted read this decode never touched the source: say so, so the prefill unpins
            # at once even if this decode's BeginTransfer was applied but its answer never arrived.
            await host.abort_room(room_id, "decode failed or was cancelled", no_read=not read_posted)

    async def _stream(
        self, events: AsyncIterator[StreamEvent], prompt_tokens: int, started: float, transfer_s: float
    ) -> AsyncIterator[pb.DecodeResponse]:
        n = 0
        async for ev in events:
            n += 1
            msg = pb.DecodeResponse(delta=_delta(ev))
            if ev.finish is not None:
                msg.finish_reason = finish_to_pb(ev.finish)
                msg.usage.CopyFrom(types_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=n))
                msg.timings.CopyFrom(
                    types_pb2.Timings(
                        transfer=to_duration(transfer_s), total=to_duration(time.perf_counter() - started)
                    )
                )
            yield msg

    async def GenerateUnified(
        self,
        request: pb.GenerateUnifiedRequest,
        context: grpc.aio.ServicerContext[pb.GenerateUnifiedRequest, pb.GenerateUnifiedResponse],
    ) -> AsyncIterator[pb.GenerateUnifiedResponse]:
        host = self.host
        if host.role != types_pb2.ROLE_UNIFIED:
            raise FailedPrecondition("this replica is a P/D decode: use Decode", reason="WRONG_ROLE")
        token_ids = list(request.token_ids)
        check_prompt(token_ids, host.engine.max_context, host.vocab_size)
        sampling = sampling_from_pb(request.sampling)
        rid = request.request_id or f"unified-{id(request)}-{time.monotonic_ns()}"
        if rid in self._live:
            raise FailedPrecondition(f"request {rid} is already running here", reason="REQUEST_BUSY")
        self._live[rid] = (0, request.request_id)
        started = time.perf_counter()
        first_at: float | None = None
        n = 0
        try:
            async for ev in host.engine.generate(rid, token_ids, sampling, cache_salt=request.cache_salt):
                n += 1
                if first_at is None:
                    first_at = time.perf_counter() - started
                msg = pb.GenerateUnifiedResponse(delta=_delta(ev))
                if ev.finish is not None:
                    msg.finish_reason = finish_to_pb(ev.finish)
                    msg.usage.CopyFrom(types_pb2.Usage(prompt_tokens=len(token_ids), completion_tokens=n))
                    msg.timings.CopyFrom(
                        types_pb2.Timings(
                            time_to_first_token=to_duration(first_at),
                            total=to_duration(time.perf_counter() - started),
                        )
                    )
                yield msg
        finally:
            self._live.pop(rid, None)
            await asyncio.shield(host.engine.abort(rid))

    async def AbortDecode(
        self,
        request: pb.AbortDecodeRequest,
        context: grpc.aio.ServicerContext[pb.AbortDecodeRequest, pb.AbortDecodeResponse],
    ) -> pb.AbortDecodeResponse:
        rids = [rid for rid, (_, client) in self._live.items() if request.request_id in (rid, client)]
        for rid in rids:
            await self.host.engine.abort(rid)
        return pb.AbortDecodeResponse(found=bool(rids))

    async def GetDecodeStats(
        self,
        request: pb.GetDecodeStatsRequest,
        context: grpc.aio.ServicerContext[pb.GetDecodeStatsRequest, pb.GetDecodeStatsResponse],
    ) -> pb.GetDecodeStatsResponse:
        host = self.host
        return pb.GetDecodeStatsResponse(
            engine=host.engine_stats_pb(pages_parked=0),
            rooms_active=self._rooms_active,
            transfer=host.kv.totals.to_pb() if host.kv is not None else types_pb2.TransferStats(),
            peer=f"{host.peer_id}@{host.epoch}",
            role=host.role,
        )

    @property
    def _rooms_active(self) -> int:
        return sum(1 for room_id, _ in self._live.values() if room_id)

    async def drain(self) -> None:
        """On shutdown: abort every live request; their streams end with FINISH_REASON_ABORT."""
        for rid in list(self._live):
            await self.host.engine.abort(rid)
