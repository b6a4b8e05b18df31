"""The `/generate` body the SGLang-hosting services build from Xavier's sampling
(`sglang_host.protocol`), what they refuse, how SGLang's cumulative logprob fields come back as deltas,
and the features an SGLang peer declares. The same bodies are checked against SGLang's real classes in
tests/sglang/test_sampling_passthrough.py."""

from __future__ import annotations

from typing import Any

import pytest
from xavier.v1 import types_pb2
from xavier_services.router.request import Prepared, needed_features, require_features
from xavier_services.sglang_host.protocol import Deltas, generate_body, sampling_params
from xavier_sglang.features import PAIR_FEATURES, UNIFIED_FEATURES, declare, features_for

from xavier_core.runtime.errors import InvalidArgument

PLAIN = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "ignore_eos": False}


def test_controls_left_off_add_no_key() -> None:
    off = types_pb2.SamplingParams(max_tokens=4, repetition_penalty=1.0)
    assert sampling_params(off) == PLAIN
    body = generate_body("r", [1, 2], off)
    assert set(body) == {"input_ids", "sampling_params", "stream", "return_logprob", "rid"}


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"min_p": 0.5}, {"min_p": 0.5}),
        ({"min_tokens": 2}, {"min_new_tokens": 2}),
        (
            {"presence_penalty": 1.0, "frequency_penalty": -0.5},
            {"presence_penalty": 1.0, "frequency_penalty": -0.5},
        ),
        ({"logit_bias": {10: 2.0, 3: -1.0}}, {"logit_bias": {"3": -1.0, "10": 2.0}}),
        ({"include_stop_str_in_output": True}, {"no_stop_trim": True}),
        ({"regex": "a+"}, {"regex": "a+"}),
        ({"json_schema": '{"type": "string"}'}, {"json_schema": '{"type": "string"}'}),
        ({"json_object": True}, {"json_schema": '{"type": "object"}'}),
    ],
)
def test_each_control_adds_its_sglang_key(kw: dict[str, Any], want: dict[str, Any]) -> None:
    assert sampling_params(types_pb2.SamplingParams(max_tokens=4, **kw)) == {**PLAIN, **want}


def test_logprob_controls_are_top_level_keys() -> None:
    s = types_pb2.SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3, prompt_logprobs=True)
    body = generate_body("", [1, 2, 3], s, stream=False)
    assert (body["return_logprob"], body["top_logprobs_num"], body["logprob_start_len"]) == (True, 3, 0)
    assert "rid" not in body and body["stream"] is False


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"min_tokens": 2, "stop": ["a"]}, "min_tokens"),
        ({"include_stop_str_in_output": True, "stop_token_ids": [2]}, "include_stop_str_in_output"),
    ],
)
def test_what_sglang_does_otherwise_is_refused_by_name(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        generate_body("r", [1], types_pb2.SamplingParams(max_tokens=4, **kw))
    assert (info.value.reason, info.value.metadata["param"]) == ("UNSUPPORTED_PARAMETER", param)


def _event(ids: list[int], meta: dict[str, Any]) -> dict[str, Any]:
    return {"text": "".join(f"<{t}>" for t in ids), "output_ids": ids, "meta_info": meta}


def test_deltas_cut_cumulative_alternatives_and_give_the_prompt_once() -> None:
    prompt = {
        "input_token_logprobs": [[None, 1, None], [-1.5, 2, None]],
        "input_top_logprobs": [None, [[-1.0, 9, None]]],
    }
    deltas = Deltas()
    one = deltas.next(_event([7], {**prompt, "output_top_logprobs": [[[-0.1, 7, None], [-2.0, 8, None]]]}))
    assert [list(t.token_ids) for t in one.top_logprobs] == [[7, 8]]
    assert one.prompt_logprobs is not None and list(one.prompt_logprobs.logprobs) == [-1.5]
    assert [list(t.token_ids) for t in one.prompt_logprobs.top_logprobs] == [[9]]
    tops = [[[-0.1, 7, None], [-2.0, 8, None]], None]  # a position without alternatives: empty
    two = deltas.next(_event([7, 5], {**prompt, "output_top_logprobs": tops}))
    assert two.token_ids == [5] and [list(t.token_ids) for t in two.top_logprobs] == [[]]
    assert two.prompt_logprobs is None


def test_sglang_pair_peers_declare_their_handoff_and_first_token() -> None:
    """The router reads how an SGLang pair hands off from the declaration, not the engine's name."""
    for role in (types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE):
        layout = declare(types_pb2.KvLayout(engine="sglang"), role)
        assert layout.handoff == types_pb2.HANDOFF_PROTOCOL_CONCURRENT
        assert layout.first_token_source == types_pb2.FIRST_TOKEN_SOURCE_DECODE
        assert tuple(layout.features) == PAIR_FEATURES
    unified = declare(types_pb2.KvLayout(engine="sglang"), types_pb2.ROLE_UNIFIED)
    assert (
        unified.handoff == types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED
        and tuple(unified.features) == UNIFIED_FEATURES
    )


def test_sglang_peers_declare_what_the_body_maps_and_the_router_checks_it() -> None:
    assert features_for(types_pb2.ROLE_PREFILL) == features_for(types_pb2.ROLE_DECODE) == PAIR_FEATURES
    assert features_for(types_pb2.ROLE_UNIFIED) == UNIFIED_FEATURES
    assert types_pb2.ENGINE_FEATURE_PENALTIES not in UNIFIED_FEATURES  # repetition_penalty is refused
    layout = types_pb2.KvLayout(engine="sglang", features=PAIR_FEATURES)
    ok = types_pb2.SamplingParams(max_tokens=4, presence_penalty=0.5, min_p=0.1, regex="a+")
    require_features(Prepared("r", (1,), ok, 0, ""), layout, "decode")
    with pytest.raises(InvalidArgument):
        s = types_pb2.SamplingParams(max_tokens=4, repetition_penalty=1.2)
        require_features(Prepared("r", (1,), s, 0, ""), layout, "decode")
    # A pair's decode streams every token's alternatives and its prefill answers the prompt's logprobs.
    asks = types_pb2.SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2, prompt_logprobs=True)
    for features in (PAIR_FEATURES, UNIFIED_FEATURES):
        require_features(Prepared("r", (1,), asks, 0, ""), types_pb2.KvLayout(features=features), "x")
    # The reference engine's PENALTIES covers the output-only two.
    reference = types_pb2.KvLayout(features=[types_pb2.ENGINE_FEATURE_PENALTIES])
    assert {f for f, _ in needed_features(ok)} >= {types_pb2.ENGINE_FEATURE_OUTPUT_PENALTIES}
    require_features(
        Prepared("r", (1,), types_pb2.SamplingParams(frequency_penalty=1.0), 0, ""), reference, "x"
    )
