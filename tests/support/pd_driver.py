"""Drives one P/D request the way the router does: OpenRoom, then Prefill and Decode concurrently.

Tests use it to exercise the prefill and decode services without the router in between.
"""

from __future__ import annotations

import asyncio
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

from xavier_core.text.fingerprint import prompt_fingerprint


@dataclass
class PdResult:
    tokens: list[int] = field(default_factory=list)
    first_token: int = -1
    finish: int = 0
    prefill_digest: bytes = b""
    decode_digest: bytes = b""
    room_id: int = 0


async def peer(directory: grpc.aio.Channel, role: int) -> dpb.Peer:
    stub = dpb_grpc.DirectoryServiceStub(directory)
    resp = await stub.ListPeers(dpb.ListPeersRequest(role=role), timeout=5)
    if not resp.peers:
        raise LookupError(f"no peer with role {role}")
    return resp.peers[0]


async def open_room(
    directory: grpc.aio.Channel,
    prefill: dpb.Peer,
    decode: dpb.Peer,
    token_ids: Sequence[int],
    lease_s: float = 0,
) -> dpb.Room:
    stub = dpb_grpc.DirectoryServiceStub(directory)
    req = dpb.OpenRoomRequest(
        request_id=uuid.uuid4().hex,
        prefill_peer_id=prefill.peer_id,
        prefill_epoch=prefill.epoch,
        decode_peer_id=decode.peer_id,
        decode_epoch=decode.epoch,
        prompt_fingerprint=prompt_fingerprint(token_ids),
        num_tokens=len(token_ids),
    )
    if lease_s:
        req.lease.FromNanoseconds(int(lease_s * 1e9))
    return (await stub.OpenRoom(req, timeout=5)).room


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
    room = await open_room(directory, prefill, decode, token_ids)
    sampling = types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = PdResult(room_id=room.room_id)

    async def run_decode() -> None:
        call = dec_grpc.DecodeServiceStub(decode_ch).Decode(
            dec.DecodeRequest(
                request_id=uuid.uuid4().hex,
                room_id=room.room_id,
                token_ids=token_ids,
                sampling=sampling,
                return_kv_digest=digests,
            ),
            timeout=timeout,
        )
        async for msg in call:
            out.tokens.extend(msg.delta.token_ids)
            if msg.kv_digest:
                out.decode_digest = msg.kv_digest
            if msg.finish_reason:
                out.finish = msg.finish_reason

    async def run_prefill() -> None:
        resp = await pre_grpc.PrefillServiceStub(prefill_ch).Prefill(
            pre.PrefillRequest(
                request_id=uuid.uuid4().hex,
                room_id=room.room_id,
                token_ids=token_ids,
                sampling=sampling,
                return_kv_digest=digests,
            ),
            timeout=timeout,
        )
        out.first_token = resp.first_token
        out.prefill_digest = resp.kv_digest

    await asyncio.gather(run_decode(), run_prefill())
    return out


async def unified_generate(
    unified_ch: grpc.aio.Channel, token_ids: Sequence[int], max_tokens: int = 16
) -> list[int]:
    call = dec_grpc.DecodeServiceStub(unified_ch).GenerateUnified(
        dec.GenerateUnifiedRequest(
            request_id=uuid.uuid4().hex,
            token_ids=token_ids,
            sampling=types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        ),
        timeout=60,
    )
    tokens: list[int] = []
    async for msg in call:
        tokens.extend(msg.delta.token_ids)
    return tokens
