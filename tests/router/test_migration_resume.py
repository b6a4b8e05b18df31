"""What a resumed request asks of its new pair: `migration.resumed` lowers max_tokens and min_tokens by
the tokens sent and marks them as resumed output, and `request.needed_features` asks for
ENGINE_FEATURE_RESUMED_OUTPUT exactly when the engine must treat them as output (a grammar, a presence
or frequency penalty)."""

from __future__ import annotations

import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2
from xavier_services.router.migration import resumed
from xavier_services.router.request import Prepared, needed_features

from xavier_core.sampling import advance_seed

RESUMED = types_pb2.ENGINE_FEATURE_RESUMED_OUTPUT


def _prep(**sampling: object) -> Prepared:
    s = types_pb2.SamplingParams(max_tokens=40, **sampling)  # type: ignore[arg-type]
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
