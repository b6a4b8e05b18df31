"""Drives one P/D request the way the router does: Prefill, then Decode from the prefill's first token.

Tests use it to exercise the prefill and decode services without the router in between. Neither side
needs the room to exist first: the prefill's publication and the decode's BeginTransfer meet by room id.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2


@dataclass
class PdResult:
    tokens: list[int] = field(default_factory=list)
    """Every generated token: the prefill's first one, then the decode's stream."""
    first_token: int = -1
    finish: int = 0
    prefill_digest: bytes = b""
    decode_digest: bytes = b""
    room_id: int = 0


def new_room_id() -> int:
    """A room id the way the router chooses one: 63-bit, never 0."""
    return secrets.randbits(63) or 1


async def peer(directory: grpc.aio.Channel, role: int) -> dpb.Peer:
    stub = dpb_grpc.DirectoryServiceStub(directory)
    resp = await stub.ListPeers(dpb.ListPeersRequest(role=role), timeout=5)
    if not resp.peers:
        raise LookupError(f"no peer with role {role}")
    return resp.peers[0]


def prefill_request(
    room_id: int, decode: dpb.Peer, token_ids: Sequence[int], sampling: types_pb2.SamplingParams, **kw: object
) -> pre.PrefillRequest:
    return pre.PrefillRequest(
        request_id=uuid.uuid4().hex,
        room_id=room_id,
        decode_peer_id=decode.peer_id,
        decode_epoch=decode.epoch,
        token_ids=token_ids,
        sampling=sampling,
        **kw,  # type: ignore[arg-type]
    )


def decode_request(
    room_id: int,
    prefill: dpb.Peer,
    token_ids: Sequence[int],
    sampling: types_pb2.SamplingParams,
    first_token: int = 1,
    first_logprob: float = 0.0,
    **kw: object,
) -> dec.DecodeRequest:
    return dec.DecodeRequest(
        request_id=uuid.uuid4().hex,
        room_id=room_id,
        prefill_peer_id=prefill.peer_id,
        prefill_epoch=prefill.epoch,
        token_ids=token_ids,
        first_token=first_token,
        first_logprob=first_logprob,
        sampling=sampling,
        **kw,  # type: ignore[arg-type]
    )


async def pd_generate(
    directory: grpc.aio.Channel,
    prefill_ch: grpc.aio.Channel,
    decode_ch: grpc.aio.Channel,
    prefill: dpb.Peer,
    decode: dpb.Peer,
    token_ids: Sequence[int],
    max_tokens: int = 16,
    digests: bool = False,
    timeout: float = 60,
) -> PdResult:
    room_id = new_room_id()
    sampling = types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = PdResult(room_id=room_id)
    try:
        resp = await pre_grpc.PrefillServiceStub(prefill_ch).Prefill(
            prefill_request(room_id, decode, token_ids, sampling, return_kv_digest=digests), timeout=timeout
        )
        out.first_token = resp.first_token
        out.prefill_digest = resp.kv_digest
        out.tokens.append(resp.first_token)
        if resp.finish_reason:
            out.finish = resp.finish_reason
            return out
        req = decode_request(
            room_id,
            prefill,
            token_ids,
            sampling,
            resp.first_token,
            resp.first_logprob,
            return_kv_digest=digests,
        )
        call = dec_grpc.DecodeServiceStub(decode_ch).Decode(req, timeout=timeout)
        try:
            async for msg in call:
                out.tokens.extend(msg.delta.token_ids)
                if msg.kv_digest:
                    out.decode_digest = msg.kv_digest
                if msg.finish_reason:
                    out.finish = msg.finish_reason
        finally:
            call.cancel()
    finally:
        if not out.finish:
            # As the router does when a request ends early: the room may not exist yet (a tombstone then).
            abort = dpb.AbortRoomRequest(
                request_id=uuid.uuid4().hex, room_id=room_id, cause=dpb.ROOM_END_CAUSE_ROUTER_ABORT
            )
            await asyncio.shield(dpb_grpc.DirectoryServiceStub(directory).AbortRoom(abort, timeout=5))
    return out


async def unified_generate(
    unified_ch: grpc.aio.Channel, token_ids: Sequence[int], max_tokens: int = 16, request_id: str = ""
) -> list[int]:
    call = dec_grpc.DecodeServiceStub(unified_ch).GenerateUnified(
        dec.GenerateUnifiedRequest(
            request_id=request_id or uuid.uuid4().hex,
            token_ids=token_ids,
            sampling=types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        ),
        timeout=60,
    )
    tokens: list[int] = []
    async for msg in call:
        tokens.extend(msg.delta.token_ids)
    return tokens
