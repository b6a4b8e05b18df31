"""The xavier backend's pair protocol messages (`xavier_sglang.wire`): each round-trips, and anything
malformed (another protocol's notification, a truncated or padded message, a forged page count) parses
as None, never as a message. No SGLang needed."""

from __future__ import annotations

import numpy as np
import pytest
from xavier_sglang import wire

TOKEN = bytes(range(16))


def test_each_message_round_trips() -> None:
    pages = np.array([5, 1, 9, 70000], dtype=np.int64)
    got = wire.parse(wire.join(123, TOKEN, pages, 4))
    assert got is not None and got.kind == wire.Kind.JOIN and got.room == 123 and got.token == TOKEN
    assert (
        got.count == 4
        and got.aux_slot == 4
        and got.pages is not None
        and got.pages.tolist() == pages.tolist()
    )
    no_aux = wire.parse(wire.join(7, TOKEN, pages[:0], None))
    assert no_aux is not None and no_aux.aux_slot is None and no_aux.count == 0
    w = wire.parse(wire.written(2**63 - 1, TOKEN, 17, last=True))
    assert w is not None and (w.kind, w.room, w.count, w.aux, w.last) == (
        wire.Kind.WRITTEN,
        2**63 - 1,
        17,
        None,
        True,
    )
    slot = bytes(range(256)) * 13  # an aux slot: the first token and its metadata
    a = wire.parse(wire.written(9, TOKEN, 5, aux=slot, last=True))
    assert a is not None and a.aux == slot and a.last and a.count == 5
    assert wire.parse(wire.written(9, TOKEN, 0, aux=b"", last=True)).aux == b""  # type: ignore[union-attr]
    assert w.aux is None
    c = wire.parse(wire.cancel(9, TOKEN))
    assert c is not None and c.kind == wire.Kind.CANCEL and c.token == TOKEN
    f = wire.parse(wire.failed(9, TOKEN, "INVALID_ARGUMENT", "page 64 is outside the pool"))
    assert (
        f is not None
        and f.kind == wire.Kind.FAILED
        and f.detail == "INVALID_ARGUMENT: page 64 is outside the pool"
    )


def test_failed_detail_is_bounded() -> None:
    f = wire.parse(wire.failed(1, TOKEN, "TRANSFER_FAILED", "x" * 10_000))
    assert f is not None and len(f.detail.encode()) <= wire.MAX_DETAIL


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"xv1:done:123:abc",  # the reference engine's notifications
        wire.written(1, TOKEN, 3)[:-1],  # truncated
        wire.written(1, TOKEN, 3) + b"\0",  # padded
        wire.cancel(1, TOKEN) + b"x",
        wire.join(1, TOKEN, np.array([1, 2]), 0)[:-1],  # the page list is shorter than its count
        wire.join(1, TOKEN, np.array([1, 2]), 0) + b"\0\0\0\0",  # longer
        wire.join(1, TOKEN, np.array([-3]), 0),  # a negative page id
        b"xv2" + bytes([99]) + wire.cancel(1, TOKEN)[4:],  # an unknown kind
    ],
    ids=["empty", "other", "short", "padded", "cancel-body", "join-short", "join-long", "negative", "kind"],
)
def test_malformed_is_none(raw: bytes) -> None:
    assert wire.parse(raw) is None


def test_an_aux_slot_is_bounded() -> None:
    with pytest.raises(ValueError):
        wire.written(1, TOKEN, 1, aux=b"x" * (wire.MAX_AUX_BYTES + 1))


def test_a_token_is_sixteen_bytes() -> None:
    with pytest.raises(ValueError):
        wire.cancel(1, b"short")
