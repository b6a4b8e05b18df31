"""The pair protocol of the xavier backend: the NIXL notifications a decode and its prefill exchange.

No gRPC and no directory on the request path: the two SGLang processes found each other once per epoch
through the directory (each knows the other's NIXL agent from its `TransferEndpoint`), and every room
then costs a handful of NIXL notifications:

- `JOIN` (decode → prefill): the room, the decode's token for it, its destination pages and aux slot.
  The prefill can now WRITE; SGLang's sender leaves Bootstrapping.
- `WRITTEN` (prefill → decode): carried by a WRITE, so NIXL delivers it once that WRITE's bytes are in
  place: `count` pages of KV. The last one also carries the bytes of the prefill's aux slot (first token
  and its metadata, a few KiB), which the decode copies into its own slot: KV and aux in one transfer.
  The decode succeeds when every page and the slot arrived.
- `CANCEL` (decode → prefill): the decode gave the room up. The prefill writes nothing more.
- `FAILED` (prefill → decode): the prefill will not write (any more) **and no WRITE of the room is in
  flight**: only now may the decode hand the pages to another request (invariant I1), which is why an
  aborted decode stays Transferring until this arrives or the prefill is known to be gone.

Every message after `JOIN` carries the decode's token, so no one but the two peers of a room can end it
or claim it written. `parse` returns None for anything that is not a well-formed message.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["TOKEN_BYTES", "Kind", "Message", "cancel", "failed", "join", "parse", "written"]

MAGIC = b"xv2"
TOKEN_BYTES = 16
MAX_PAGES = 1 << 20
"""The most destination pages one JOIN may name (a 16M-token prompt at page size 16)."""
MAX_DETAIL = 512
MAX_AUX_BYTES = 1 << 20
"""The most aux bytes one WRITTEN may carry (an SGLang slot is a few KiB: token ids, logprobs, a hidden
state for speculative decoding)."""
_HEAD = struct.Struct("<3sBQ16sIiB")  # magic, kind, room, token, count, aux slot (-1: none), flags
_AUX = 1
_LAST = 2


class Kind(enum.IntEnum):
    JOIN = 1
    WRITTEN = 2
    CANCEL = 3
    FAILED = 4


@dataclass(frozen=True)
class Message:
    """One decoded notification (fields unused by its kind are zero / empty)."""

    kind: Kind
    room: int
    token: bytes
    count: int = 0
    """JOIN: destination pages; WRITTEN: pages this WRITE carried (0 for the aux slot)."""
    aux_slot: int | None = None
    aux: bytes | None = None
    """WRITTEN: the prefill's aux slot, when this WRITE ends the room's KV."""
    last: bool = False
    """WRITTEN: the prefill's last WRITE of the room."""
    pages: npt.NDArray[np.int64] | None = None
    """JOIN: the destination page ids, in the order of the source's pages."""
    detail: str = ""
    """FAILED: the Xavier reason and a sentence, `REASON: sentence`."""


def _pack(
    kind: Kind, room: int, token: bytes, count: int = 0, aux_slot: int | None = None, flags: int = 0
) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a room token is {TOKEN_BYTES} bytes")
    return _HEAD.pack(MAGIC, int(kind), room, token, count, -1 if aux_slot is None else aux_slot, flags)


def join(room: int, token: bytes, pages: npt.NDArray[np.integer], aux_slot: int | None) -> bytes:
    body = np.ascontiguousarray(pages, dtype="<i4")
    return _pack(Kind.JOIN, room, token, int(body.size), aux_slot) + body.tobytes()


def written(room: int, token: bytes, count: int, *, aux: bytes | None = None, last: bool = False) -> bytes:
    if aux is not None and len(aux) > MAX_AUX_BYTES:
        raise ValueError(f"an aux slot of {len(aux)} bytes is over {MAX_AUX_BYTES}")
    flags = (_AUX if aux is not None else 0) | (_LAST if last else 0)
    return _pack(Kind.WRITTEN, room, token, count, flags=flags) + (aux or b"")


def cancel(room: int, token: bytes) -> bytes:
    return _pack(Kind.CANCEL, room, token)


def failed(room: int, token: bytes, reason: str, detail: str) -> bytes:
    text = f"{reason}: {detail}".encode()[:MAX_DETAIL]
    return _pack(Kind.FAILED, room, token) + text


def parse(msg: bytes) -> Message | None:
    """The message in `msg`, or None if it is not one (another protocol's notification, or malformed)."""
    if len(msg) < _HEAD.size or not msg.startswith(MAGIC):
        return None
    _, kind_raw, room, token, count, aux_slot, flags = _HEAD.unpack_from(msg)
    try:
        kind = Kind(kind_raw)
    except ValueError:
        return None
    body = msg[_HEAD.size :]
    slot = None if aux_slot < 0 else int(aux_slot)
    if kind == Kind.JOIN:
        if count > MAX_PAGES or len(body) != 4 * count:
            return None
        pages = np.frombuffer(body, dtype="<i4").astype(np.int64)
        if pages.size and int(pages.min()) < 0:
            return None
        return Message(kind, int(room), bytes(token), int(count), slot, pages=pages)
    if kind == Kind.WRITTEN:
        has_aux = bool(flags & _AUX)
        if (body and not has_aux) or len(body) > MAX_AUX_BYTES:
            return None
        aux = bytes(body) if has_aux else None
        return Message(kind, int(room), bytes(token), int(count), aux=aux, last=bool(flags & _LAST))
    if kind == Kind.FAILED:
        if len(body) > MAX_DETAIL:
            return None
        return Message(kind, int(room), bytes(token), detail=body.decode(errors="replace"))
    return None if body else Message(kind, int(room), bytes(token))
