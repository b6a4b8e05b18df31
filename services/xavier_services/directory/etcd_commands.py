"""The directory's commands: what a replica applies for each logged call, and their stored form.

A command is JSON: the op, the proposer's wall time, the proposer (process id, sequence number) and the
arguments, with messages as base64 of their deterministic wire bytes (never pickle: the bytes come back
from a network store).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_services.directory.snapshot import from_b64, to_b64
from xavier_services.directory.state import DirectoryState, Pair

__all__ = ["OPS", "Arg", "Command", "decode_command", "encode_command"]

_MESSAGES: dict[str, type[Message]] = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (dpb.SourceDescriptor, dpb.PeerLoad, types_pb2.KvLayout, types_pb2.TransferEndpoint)
}
Arg = str | int | float | bool | None | Message


def _pair(a: list[Any]) -> Pair:
    return Pair(a[0], a[1], a[2], a[3])


# op -> how a replica applies it (args as proposed).
OPS: dict[str, Callable[[DirectoryState, list[Any]], Any]] = {
    "register": lambda s, a: s.peers.register(*a),
    "heartbeat": lambda s, a: s.peers.heartbeat(*a),
    "unregister": lambda s, a: s.peers.unregister(*a),
    "publish": lambda s, a: s.publish_source(a[0], a[1], _pair(a[2:6]), a[6]),
    "join": lambda s, a: s.join_as_decode(a[0], _pair(a[1:5])),
    "begin": lambda s, a: s.begin_transfer(*a),
    "complete": lambda s, a: s.complete_room(*a),
    "abort": lambda s, a: s.abort_room(*a),
    "sweep": lambda s, a: s.sweep(),
}


@dataclass(frozen=True, slots=True)
class Command:
    """One logged call: the op, its proposer's wall time, who proposed it (process, sequence) and args."""

    op: str
    time: float
    source: str
    seq: int
    args: list[Any]


def _encode_arg(value: Arg) -> Any:
    if isinstance(value, Message):
        return {"pb": value.DESCRIPTOR.full_name, "b": to_b64(value)}
    return value


def _decode_arg(value: Any) -> Any:
    if isinstance(value, dict):
        return from_b64(_MESSAGES[value["pb"]], value["b"])
    return value


def encode_command(cmd: Command) -> bytes:
    """The command as stored in etcd (JSON; messages as base64 of their deterministic bytes)."""
    body = {"op": cmd.op, "t": cmd.time, "src": cmd.source, "n": cmd.seq}
    return json.dumps({**body, "a": [_encode_arg(a) for a in cmd.args]}, separators=(",", ":")).encode()


def decode_command(data: bytes) -> Command:
    """Inverse of :func:`encode_command`; ValueError/KeyError on anything else."""
    raw = json.loads(data)
    if raw["op"] not in OPS:
        raise ValueError(f"unknown directory command {raw['op']!r}")
    args = [_decode_arg(a) for a in raw["a"]]
    return Command(raw["op"], float(raw["t"]), str(raw["src"]), int(raw["n"]), args)
