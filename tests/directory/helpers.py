"""Peers, layouts and full room lifecycles for directory tests."""

from __future__ import annotations

import asyncio
import contextlib

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.directory import DirectoryClient, Registration
from xavier_core.runtime.errors import NotFound


def layout(**changes: object) -> types_pb2.KvLayout:
    fields: dict[str, object] = dict(
        engine="reference",
        engine_version="0.1",
        dtype="float32",
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        memory_layout="mha_layer_kv_slot_head_dim",
        weights_fingerprint="w" * 64,
        tokenizer_fingerprint="t" * 64,
        config_fingerprint="c" * 64,
        model_name="tiny",
    )
    fields.update(changes)
    return types_pb2.KvLayout(**fields)  # type: ignore[arg-type]


def endpoint(name: str = "agent") -> types_pb2.TransferEndpoint:
    return types_pb2.TransferEndpoint(
        kind=types_pb2.TRANSPORT_KIND_NIXL,
        agent_name=name,
        agent_metadata=b"meta",
        regions=[types_pb2.MemoryRegion(base_address=4096, length=1 << 20, device="cpu", bytes_per_page=256)],
        host_id="host",
    )


def register_request(peer_id: str, role: int, **layout_changes: object) -> dpb.RegisterPeerRequest:
    return dpb.RegisterPeerRequest(
        peer_id=peer_id,
        role=role,  # type: ignore[arg-type]
        address=f"127.0.0.1:{1000 + len(peer_id)}",
        layout=layout(**layout_changes),
        endpoint=endpoint(peer_id),
    )


def source(num_pages: int = 3) -> dpb.SourceDescriptor:
    return dpb.SourceDescriptor(
        page_runs=[types_pb2.PageRun(first_page=10, count=num_pages)],
        num_pages=num_pages,
        num_tokens=num_pages * 4,
    )


async def lifecycle(
    client: DirectoryClient, prefill: Registration, decode: Registration, room_id: int
) -> list[int]:
    """decode opens and waits → prefill publishes → decode begins → completes; returns the states seen."""
    p, d = (prefill.peer_id, prefill.epoch), (decode.peer_id, decode.epoch)
    begin = asyncio.ensure_future(client.begin_transfer(room_id, p, d, wait_for_source=10))
    while True:  # the decode's BeginTransfer opens the room, then waits in it
        with contextlib.suppress(NotFound):
            if (await client.get_room(room_id)).state == dpb.ROOM_STATE_OPEN:
                break
        await asyncio.sleep(0.005)
    seen = [dpb.ROOM_STATE_OPEN, (await client.publish_source(room_id, p, d, source())).state]
    resp = await begin
    assert resp.source_endpoint.agent_name == prefill.peer_id and resp.room.source.num_pages == 3
    seen.append(resp.room.state)
    seen.append((await client.complete_room(room_id, *d)).state)
    return seen
