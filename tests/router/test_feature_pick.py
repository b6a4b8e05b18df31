"""Pair and replica selection prefers engines that declare what a request needs (`request.serves`): in a
mesh of mixed engines a grammar request, or a move that carries resumed output, goes to a pair that can
serve it even when another pair is less loaded; with no such pair it goes where it would have gone, and
that engine refuses it by name."""

from __future__ import annotations

import time

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2
from xavier_services.router.peers import PeerPool
from xavier_services.router.request import Prepared, require_features, serves

from xavier_core.runtime import InvalidArgument

GRAMMAR = types_pb2.ENGINE_FEATURE_STRUCTURED_OUTPUT
RESUMED = types_pb2.ENGINE_FEATURE_RESUMED_OUTPUT


def _peer(name: str, role: int, load: int, fp: str = "f", *features: int) -> dpb.Peer:
    return dpb.Peer(
        peer_id=name,
        role=role,
        contract_fingerprint=fp,
        layout=types_pb2.KvLayout(features=features),
        load=dpb.PeerLoad(outstanding_requests=load),
    )


def _pool(*peers: dpb.Peer) -> PeerPool:
    pool = PeerPool("", rpc_timeout=1.0, refresh_seconds=1e9, attempts=1)
    pool._peers, pool._fetched_at = list(peers), time.monotonic()  # a fresh ListPeers answer
    return pool


def _prep(**sampling: object) -> Prepared:
    s = types_pb2.SamplingParams(**{"max_tokens": 8, **sampling})  # type: ignore[arg-type]
    return Prepared("rid", (5, 6, 7), s, rpb.ROUTING_MODE_PD, "")


P, D, U = types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE, types_pb2.ROLE_UNIFIED


def _mixed() -> PeerPool:
    """An idle pair that declares nothing (fingerprint "a") and a busy one that declares grammars and
    resumed output ("b")."""
    return _pool(
        _peer("pa", P, 0, "a"),
        _peer("da", D, 0, "a"),
        _peer("pb", P, 5, "b", GRAMMAR, RESUMED),
        _peer("db", D, 5, "b", GRAMMAR, RESUMED),
    )


async def test_a_request_that_needs_nothing_takes_the_least_loaded_pair() -> None:
    assert serves(_prep()) is None
    pair = await _mixed().pick_pair(None, frozenset(), serves(_prep()))
    assert (pair.prefill.peer_id, pair.decode.peer_id) == ("pa", "da")


@pytest.mark.parametrize(
    "sampling",
    [{"regex": "[a-z]+"}, {"regex": "[a-z]+", "resumed_output_tokens": 3}],
    ids=["grammar", "a grammar request's move"],
)
async def test_a_request_goes_to_the_pair_that_declares_what_it_needs(sampling: dict[str, object]) -> None:
    prep = _prep(**sampling)
    pair = await _mixed().pick_pair(None, frozenset(), serves(prep))
    assert (pair.prefill.peer_id, pair.decode.peer_id) == ("pb", "db")
    require_features(prep, pair.prefill.layout, "prefill")  # what the flow checks next: it passes
    require_features(prep, pair.decode.layout, "decode")


async def test_a_decode_alone_that_declares_it_is_not_a_pair() -> None:
    """Only a prefill and a decode of one fingerprint that both declare the features count."""
    prep = _prep(regex="[a-z]+")
    pool = _pool(_peer("pa", P, 0, "a"), _peer("da", D, 0, "a", GRAMMAR), _peer("db", D, 0, "b", GRAMMAR))
    pair = await pool.pick_pair(None, frozenset(), serves(prep))
    assert (pair.prefill.peer_id, pair.decode.peer_id) == ("pa", "da")  # as before: no able pair
    with pytest.raises(InvalidArgument) as info:
        require_features(prep, pair.prefill.layout, "prefill")
    assert info.value.reason == "UNSUPPORTED_PARAMETER" and info.value.metadata["param"] == "grammar"


async def test_a_unified_request_goes_to_a_replica_that_declares_what_it_needs() -> None:
    pool = _pool(_peer("u0", U, 0), _peer("u1", U, 9, "f", GRAMMAR))
    assert (await pool.pick_unified(frozenset(), serves(_prep(json_object=True)))).peer_id == "u1"
    assert (await pool.pick_unified(frozenset(), serves(_prep()))).peer_id == "u0"
    none = _pool(_peer("u0", U, 0), _peer("u1", U, 9))
    assert (await none.pick_unified(frozenset(), serves(_prep(json_object=True)))).peer_id == "u0"
