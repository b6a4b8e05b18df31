"""Which handoff the router runs for a pair follows what its peers declare (`KvLayout.handoff`)."""

from __future__ import annotations

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.router.pair_call import Order, call_order, pair_handoff
from xavier_services.router.peers import Pair

P = types_pb2.HANDOFF_PROTOCOL_PAIR
ROOMS = types_pb2.HANDOFF_PROTOCOL_DIRECTORY_ROOMS
CONCURRENT = types_pb2.HANDOFF_PROTOCOL_CONCURRENT
OLD = types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED


def _peer(role: int, handoff: int, engine: str) -> dpb.Peer:
    return dpb.Peer(peer_id=f"p{role}", role=role, layout=types_pb2.KvLayout(engine=engine, handoff=handoff))


@pytest.mark.parametrize(
    ("prefill", "decode", "engine", "want"),
    [
        (P, P, "reference", "pair"),
        (P, ROOMS, "reference", "rooms"),  # one peer on the directory protocol: rooms for both
        (ROOMS, P, "reference", "rooms"),
        (OLD, OLD, "reference", "rooms"),  # peers of xavier.v1.0
        (OLD, P, "reference", "rooms"),
        (CONCURRENT, CONCURRENT, "sglang", "concurrent"),
        (OLD, OLD, "sglang", "concurrent"),  # SGLang peers registered before they declared it
    ],
)
def test_the_declared_protocol_picks_the_handoff(prefill: int, decode: int, engine: str, want: str) -> None:
    pair = Pair(_peer(types_pb2.ROLE_PREFILL, prefill, engine), _peer(types_pb2.ROLE_DECODE, decode, engine))
    concurrent = call_order(pair) is Order.CONCURRENT
    got = "concurrent" if concurrent else "pair" if pair_handoff(pair) else "rooms"
    assert got == want
