"""How a session cuts what it queued into messages: in order, each under the byte bound, an item larger
than the bound alone."""

from __future__ import annotations

from xavier.v1 import decode_service_pb2 as dec

from xavier_core.runtime.session_client import batches


def _call(i: int, tokens: int) -> dec.DecodeSessionCall:
    return dec.DecodeSessionCall(call_id=i, decode=dec.DecodeRequest(token_ids=list(range(tokens))))


def test_batches_keep_order_and_stay_under_the_bound() -> None:
    calls = [_call(i, n) for i, n in enumerate([10, 300, 20, 5000, 40, 40], start=1)]
    limit = 1200
    cut = list(batches(calls, limit))
    assert [c.call_id for batch in cut for c in batch] == [1, 2, 3, 4, 5, 6]
    for batch in cut:
        size = sum(c.ByteSize() for c in batch)
        assert size <= limit or len(batch) == 1, [c.call_id for c in batch]
    assert [c.call_id for c in cut[1]] == [4]  # larger than the bound: alone
    assert len(cut) == 3


def test_a_small_burst_is_one_message() -> None:
    assert [len(b) for b in batches([_call(i, 8) for i in range(16)])] == [16]
    assert list(batches([])) == []
