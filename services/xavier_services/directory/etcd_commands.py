"""The stored form of the directory's commands (`commands.py`) in the etcd log.

An entry is JSON: the op, the proposer's wall time, the proposer (process id, sequence number) and the
command's fields in declaration order as a list (a `Pair` as its four values), with messages as base64 of
their deterministic wire bytes (never pickle: the bytes come back from a network store). Reading one back
checks every field's type against the command's declaration, so a malformed entry is unreadable on every
replica alike rather than a wrong call on one.

This is the form the log had when commands were names with positional arguments, unchanged: directories
before and after the commands became dataclasses read each other's entries, so a mixed-version pair of
replicas agrees.
"""

from __future__ import annotations

import functools
import json
from dataclasses import MISSING, astuple, dataclass, fields
from typing import Any, get_type_hints

from google.protobuf.message import Message
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_services.directory import commands
from xavier_services.directory.commands import Command
from xavier_services.directory.snapshot import from_b64, to_b64
from xavier_services.directory.state import Pair

__all__ = ["COMMANDS", "Arg", "Entry", "command_args", "command_from_args", "decode_entry", "encode_entry"]

_MESSAGES: dict[str, type[Message]] = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (dpb.SourceDescriptor, dpb.PeerLoad, types_pb2.KvLayout, types_pb2.TransferEndpoint)
}
Arg = str | int | float | bool | None | Message

COMMANDS: dict[str, type[Command[Any]]] = {
    cls.op: cls
    for cls in (
        commands.Register,
        commands.Heartbeat,
        commands.Unregister,
        commands.Publish,
        commands.Join,
        commands.Begin,
        commands.Complete,
        commands.Abort,
        commands.Sweep,
    )
}
"""Every command by its name in the log."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One logged command, its proposer's wall time and who proposed it (process, sequence)."""

    command: Command[Any]
    time: float
    source: str
    seq: int


@functools.cache
def _fields(cls: type[Any]) -> list[tuple[str, Any, bool]]:
    """(name, declared type, has a default) of each field of a dataclass, in declaration order."""
    hints = get_type_hints(cls)
    return [(f.name, hints[f.name], f.default is not MISSING) for f in fields(cls)]


def command_args(command: Command[Any]) -> list[Arg]:
    """The command's fields in stored order, a `Pair` as its four values."""
    args: list[Arg] = []
    for name, _, _ in _fields(type(command)):
        value = getattr(command, name)
        if isinstance(value, Pair):
            args.extend(astuple(value))
        else:
            args.append(value)
    return args


def command_from_args(op: str, args: list[Any]) -> Command[Any]:
    """The command ``op`` from its fields as :func:`command_args` lists them (trailing defaults may be
    left out); ValueError for an unknown op, TypeError for a field of the wrong type or count."""
    cls = COMMANDS.get(op)
    if cls is None:
        raise ValueError(f"unknown directory command {op!r}")
    rest = list(args)
    values: dict[str, Any] = {}
    for name, kind, has_default in _fields(cls):
        if kind is Pair:
            values[name] = Pair(*(_take(op, f"{name}.{part}", hint, rest) for part, hint, _ in _fields(Pair)))
        elif rest or not has_default:
            values[name] = _take(op, name, kind, rest)
    if rest:
        raise TypeError(f"directory command {op!r} has {len(rest)} arguments too many")
    return cls(**values)


def _take(op: str, name: str, kind: Any, rest: list[Any]) -> Any:
    if not rest:
        raise TypeError(f"directory command {op!r} lacks {name}")
    value = rest.pop(0)
    if not isinstance(value, kind):
        raise TypeError(f"directory command {op!r}: {name} is a {type(value).__name__}")
    return value


def _encode_arg(value: Arg) -> Any:
    if isinstance(value, Message):
        return {"pb": value.DESCRIPTOR.full_name, "b": to_b64(value)}
    return value


def _decode_arg(value: Any) -> Any:
    if isinstance(value, dict):
        return from_b64(_MESSAGES[value["pb"]], value["b"])
    return value


def encode_entry(entry: Entry) -> bytes:
    """The entry as stored in etcd (JSON; messages as base64 of their deterministic bytes)."""
    body = {"op": entry.command.op, "t": entry.time, "src": entry.source, "n": entry.seq}
    args = [_encode_arg(a) for a in command_args(entry.command)]
    return json.dumps({**body, "a": args}, separators=(",", ":")).encode()


def decode_entry(data: bytes) -> Entry:
    """Inverse of :func:`encode_entry`; ValueError, KeyError or TypeError on anything else."""
    raw = json.loads(data)
    command = command_from_args(raw["op"], [_decode_arg(a) for a in raw["a"]])
    return Entry(command, float(raw["t"]), str(raw["src"]), int(raw["n"]))
