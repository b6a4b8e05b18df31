"""A directory state as bytes and back: what lets the etcd command log be compacted.

The form is JSON with every message as base64 of its wire bytes, written field by field (not pickle:
the bytes come back from a network store, and loading them must never run code). A state loaded from
a snapshot answers every call exactly as the state that was dumped: the same rooms (live, ended and
tombstones, with their request ids and leases), peers with their epochs and leases, epoch history,
RegisterPeer idempotency entries and counters.
"""

from __future__ import annotations

import base64
import json
from collections import OrderedDict
from typing import Any, TypeVar

from google.protobuf.message import Message
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.contract import KvLayout
from xavier_services.directory.records import PeerRecord, RoomRecord
from xavier_services.directory.state import DirectoryState

__all__ = ["dump_state", "load_state"]

VERSION = 1
M = TypeVar("M", bound=Message)


def to_b64(msg: Message | None) -> str | None:
    """A message as base64 text of its deterministic serialization (the stored form in etcd)."""
    return None if msg is None else base64.b64encode(msg.SerializeToString(deterministic=True)).decode()


def from_b64(cls: type[M], text: str | None) -> M | None:
    """The message `to_b64` stored."""
    if text is None:
        return None
    msg = cls()
    msg.ParseFromString(base64.b64decode(text))
    return msg


def _room(r: RoomRecord) -> list[Any]:
    ids = list(r.request_ids) if r.request_ids is not None else None
    return [r.room_id, r.state, r.prefill_peer_id, r.prefill_epoch, r.decode_peer_id, r.decode_epoch,
            r.expires_at, to_b64(r.source), r.end_cause, r.end_detail, r.read_declined, ids]  # fmt: skip


def _unroom(v: list[Any]) -> RoomRecord:
    room = RoomRecord(v[0], v[1], v[2], v[3], v[4], v[5], v[6], source=from_b64(dpb.SourceDescriptor, v[7]))
    room.end_cause, room.end_detail, room.read_declined = v[8], v[9], v[10]
    room.request_ids = None if v[11] is None else dict.fromkeys(v[11])
    return room


def _peer(p: PeerRecord) -> list[Any]:
    return [p.peer_id, p.epoch, p.role, p.address, to_b64(p.layout), to_b64(p.endpoint), p.expires_at,
            to_b64(p.load), sorted(p.rooms)]  # fmt: skip


def _unpeer(v: list[Any]) -> PeerRecord:
    layout = from_b64(types_pb2.KvLayout, v[4])
    kv = KvLayout.from_proto(layout) if layout is not None else None
    return PeerRecord(
        peer_id=v[0], epoch=v[1], role=v[2], address=v[3], layout=layout, kv_layout=kv,
        fingerprint=kv.fingerprint if kv is not None else "",
        endpoint=from_b64(types_pb2.TransferEndpoint, v[5]),
        expires_at=v[6], load=from_b64(dpb.PeerLoad, v[7]), rooms=set(v[8]),
    )  # fmt: skip


def dump_state(state: DirectoryState, applied: int, now: float) -> bytes:
    """The state after log revision ``applied`` (``now``: its clock then) as bytes."""
    peers = state.peers
    body = {
        "version": VERSION,
        "applied": applied,
        "time": now,
        "rooms": [_room(r) for r in state._rooms.values()],
        "ended": [_room(r) for r in state._ended.values()],
        "tombstones": [_room(r) for r in state._tombstones.values()],
        "by_state": sorted(state._by_state.items()),
        "opened": state._opened,
        "peers": [_peer(p) for p in peers._peers.values()],
        "last_epoch": sorted(peers._last_epoch.items()),
        "register_ids": [[k, *v] for k, v in peers._register_ids.items()],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def load_state(state: DirectoryState, data: bytes) -> tuple[int, float]:
    """Replaces ``state``'s contents (in place: the servicer keeps its reference) with a snapshot's.

    Returns (log revision applied, clock). ValueError on a snapshot of another format version.
    """
    body = json.loads(data)
    if body.get("version") != VERSION:
        raise ValueError(f"directory snapshot version {body.get('version')!r}, this build reads {VERSION}")
    state._rooms = {r.room_id: r for r in map(_unroom, body["rooms"])}
    state._ended = OrderedDict((r.room_id, r) for r in map(_unroom, body["ended"]))
    state._tombstones = OrderedDict((r.room_id, r) for r in map(_unroom, body["tombstones"]))
    state.rebuild_expiry()
    state._by_state = {int(k): int(v) for k, v in body["by_state"]}
    state._opened = int(body["opened"])
    peers = state.peers
    peers._peers = {p.peer_id: p for p in map(_unpeer, body["peers"])}
    peers._last_epoch = {k: int(v) for k, v in body["last_epoch"]}
    peers._register_ids = OrderedDict((k, (pid, int(epoch))) for k, pid, epoch in body["register_ids"])
    return int(body["applied"]), float(body["time"])
