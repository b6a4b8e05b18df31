"""What a resumed request asks of its new pair: `migration.resumed` lowers max_tokens and min_tokens by
the tokens sent and marks them as resumed output, `request.needed_features` asks for
ENGINE_FEATURE_RESUMED_OUTPUT exactly when the engine must treat them as output (a grammar, a presence
or frequency penalty), and `migrating` moves such a request only to a pair that declares it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2
from xavier_services.router.flows import PeerFailed, Step, StreamBroken
from xavier_services.router.migration import Migration, migrating, resumed
from xavier_services.router.request import Prepared, needed_features, require_features

from xavier_core.engine.tiny import make_tiny
from xavier_core.runtime import Unavailable
from xavier_core.sampling import advance_seed
from xavier_core.text.tokenizer import TextTokenizer

RESUMED = types_pb2.ENGINE_FEATURE_RESUMED_OUTPUT


def _prep(**sampling: object) -> Prepared:
    s = types_pb2.SamplingParams(**{"max_tokens": 40, **sampling})  # type: ignore[arg-type]
    return Prepared("rid", (5, 6, 7), s, rpb.ROUTING_MODE_PD, "")


def test_a_resume_counts_the_tokens_sent_once() -> None:
    prep = _prep(min_tokens=10, seed=9, prompt_logprobs=True, frequency_penalty=0.5)
    first = resumed(prep, [11, 12, 13], 1)
    assert first.token_ids == (5, 6, 7, 11, 12, 13) and first.request_id == "rid.m1"
    s = first.sampling
    assert (s.max_tokens, s.min_tokens, s.resumed_output_tokens) == (37, 7, 3)
    assert s.seed == advance_seed(9, 3) and not s.prompt_logprobs and s.frequency_penalty == 0.5
    # A second move starts again from the request as the client sent it, with every token sent.
    second = resumed(prep, list(range(20, 32)), 2)
    assert (second.sampling.max_tokens, second.sampling.min_tokens) == (28, 0)  # min_tokens floors at 0
    assert second.sampling.resumed_output_tokens == 12 and second.token_ids[3:] == tuple(range(20, 32))
    assert prep.sampling.min_tokens == 10 and prep.sampling.resumed_output_tokens == 0  # untouched


@pytest.mark.parametrize(
    ("sampling", "needs"),
    [
        ({"frequency_penalty": 0.5}, True),
        ({"presence_penalty": -1.0}, True),
        ({"json_object": True}, True),
        ({"regex": "[a-z]+"}, True),
        ({"repetition_penalty": 1.3}, False),  # counts the prompt anyway
        ({"min_tokens": 5}, False),  # lowered by the router
        ({"logit_bias": {4: 1.0}}, False),
        ({}, False),
    ],
)
def test_resumed_output_is_needed_only_where_output_matters(sampling: dict[str, object], needs: bool) -> None:
    prep = _prep(**sampling)
    assert RESUMED not in [f for f, _ in needed_features(prep.sampling)]  # a plain first attempt
    later = resumed(prep, [11, 12], 1)
    assert ((RESUMED, "resumed_output_tokens") in needed_features(later.sampling)) is needs


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.load(make_tiny(tmp_path_factory.mktemp("resume") / "qwen2", "qwen2"))


def _broken(peer_id: str) -> StreamBroken:
    peer = dpb.Peer(peer_id=peer_id, role=types_pb2.ROLE_DECODE)
    return StreamBroken(PeerFailed(peer, Unavailable("gone", reason="UNAVAILABLE"), "unavailable"))


async def _move_once(tok: TextTokenizer, declared: list[int]) -> tuple[list[Step], list[Prepared]]:
    """A grammar request whose decode breaks after two tokens, resumed on a pair declaring `declared`
    (the flow's own feature check); the steps the client got and the requests each attempt ran."""
    prep = _prep(regex="[a-z]+", max_tokens=6)
    layout = types_pb2.KvLayout(features=declared)
    runs: list[Prepared] = []
    avoided: list[frozenset[str]] = []

    async def run(p: Prepared, avoid: frozenset[str]) -> AsyncIterator[Step]:
        runs.append(p)
        avoided.append(avoid)
        require_features(p, layout, "decode")
        if len(runs) == 1:
            yield Step([70, 71], "")
            raise _broken("decode-0")
        yield Step([72, 73, 74, 75], "", finish=types_pb2.FINISH_REASON_LENGTH)

    steps = [s async for s in migrating(prep, run, 2, tok, [])]
    # The move leaves out the peer the stream broke on (its epoch: a restart is another peer).
    assert avoided == [frozenset(), frozenset({"decode-0@0"})][: len(avoided)]
    return steps, runs


async def test_a_grammar_request_moves_only_to_a_pair_that_declares_resumed_output(
    tok: TextTokenizer,
) -> None:
    every = list(types_pb2.EngineFeature.values()[1:])
    steps, runs = await _move_once(tok, every)
    assert [t for s in steps for t in s.token_ids] == [70, 71, 72, 73, 74, 75]
    assert runs[1].sampling.resumed_output_tokens == 2 and runs[1].sampling.regex == "[a-z]+"
    without = [f for f in every if f != RESUMED]
    with pytest.raises(Unavailable) as info:
        await _move_once(tok, without)
    assert info.value.reason == "MIGRATION_FAILED" and info.value.metadata["why"] == "UNSUPPORTED_PARAMETER"
    assert "resumed_output_tokens" in info.value.message and info.value.metadata["peer_id"] == "decode-0"


async def test_a_move_reports_the_cached_count_of_the_first_step_that_has_one(tok: TextTokenizer) -> None:
    """A concurrent pair's prefill answers beside the decode's stream, so its cached count may come on a
    later step of the new attempt than the first: the move's record takes the first one given."""
    prep = _prep(max_tokens=5)
    attempts = 0

    async def run(p: Prepared, avoid: frozenset[str]) -> AsyncIterator[Step]:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            yield Step([70, 71], "", cached_tokens=0)
            raise _broken("decode-0")
        yield Step([72], "")
        yield Step([73], "", cached_tokens=4)
        yield Step([74], "", cached_tokens=1, finish=types_pb2.FINISH_REASON_LENGTH)

    moves: list[Migration] = []
    steps = [s async for s in migrating(prep, run, 2, tok, moves)]
    assert [t for s in steps for t in s.token_ids] == [70, 71, 72, 73, 74]
    assert len(moves) == 1 and moves[0].cached_tokens == 4
    assert "/cached=4/of=5/" in moves[0].describe()
