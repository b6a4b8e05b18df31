"""OpenAI request parsing and SSE framing, and the sampling limits HTTP and gRPC share."""

from __future__ import annotations

import json

import grpc
import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2
from xavier_services.peer.convert import sampling_from_pb
from xavier_services.router.openai_http import OpenAiFront, error_response
from xavier_services.router.openai_logprobs import ChoiceLogprobs
from xavier_services.router.openai_shapes import TextChunks, choice, envelope, parse, sse
from xavier_services.router.request import Prepared, check_sampling_pb, require_features

from xavier_core.runtime import CapacityExhausted, InvalidArgument
from xavier_core.runtime.domain_errors import sampling_status
from xavier_core.sampling import MAX_TOKENS, SamplingError


def test_sse_framing() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    frame = sse({"a": "é\n"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert json.loads(frame[6:]) == {"a": "é\n"}


def test_parse_completion_defaults_and_fields() -> None:
    oa = parse({"prompt": "hi", "stop": "x", "seed": 3, "logprobs": 0, "xavier_mode": "pd"}, False, "m", 16)
    r = oa.request
    assert r.text == "hi" and r.sampling.max_tokens == 16 and r.sampling.temperature == 1.0
    assert list(r.sampling.stop) == ["x"] and r.sampling.seed == 3 and r.sampling.logprobs
    assert r.mode == rpb.ROUTING_MODE_PD and oa.model == "m" and not oa.stream


def test_xavier_migration_is_on_unless_the_body_says_false() -> None:
    assert not parse({"prompt": "hi"}, False, "m", 16).request.no_migration
    assert not parse({"prompt": "hi", "xavier_migration": True}, False, "m", 16).request.no_migration
    assert parse({"prompt": "hi", "xavier_migration": False}, False, "m", 16).request.no_migration
    with pytest.raises(InvalidArgument) as info:
        parse({"prompt": "hi", "xavier_migration": "false"}, False, "m", 16)
    assert info.value.metadata["param"] == "xavier_migration"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": "a", "n": 257}, "UNSUPPORTED_N"),
        ({"prompt": ["a", "b"], "n": 129}, "UNSUPPORTED_N"),
        ({"prompt": ["a", 5]}, "INVALID_PROMPT"),
        ({"prompt": ["a", ["x"]]}, "INVALID_PROMPT"),
        ({"prompt": ["a", ""]}, "EMPTY_PROMPT"),
        ({"prompt": ["a"] * 257}, "INVALID_PROMPT"),
        ({"prompt": "a", "best_of": 2, "stream": True}, "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "max_tokens": 0}, "INVALID_MAX_TOKENS"),
        ({"prompt": "a", "max_tokens": True}, "INVALID_MAX_TOKENS"),
        ({"prompt": "a", "top_p": 2}, "INVALID_SAMPLING"),
        ({"prompt": "a", "stop": [1]}, "INVALID_SAMPLING"),
        ({"prompt": "a", "xavier_mode": "warp"}, "INVALID_MODE"),
        ({}, "EMPTY_PROMPT"),
    ],
)
def test_parse_rejects(body: dict[str, object], reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse(body, False, "m", 16)
    assert info.value.reason == reason


def test_a_prompt_batch_is_one_request_per_prompt() -> None:
    oa = parse(
        {"prompt": ["one", [5, 6, 7], "three"], "max_tokens": 3, "seed": 9, "user_request_id": "r"},
        False,
        "m",
        16,
    )
    reqs = [oa.request, *oa.more]
    assert [r.WhichOneof("prompt") for r in reqs] == ["text", "token_ids", "text"]
    assert reqs[0].text == "one" and list(reqs[1].token_ids.ids) == [5, 6, 7] and reqs[2].text == "three"
    assert all(r.sampling.max_tokens == 3 and r.sampling.seed == 9 for r in reqs)
    assert [r.request_id for r in reqs] == ["r", "r-1", "r-2"]
    single = parse({"prompt": ["only"]}, False, "m", 16)
    assert single.request.text == "only" and single.more == ()


def test_chat_shapes() -> None:
    oa = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True, "m", 16)
    assert oa.request.chat.messages[0].content == "hi"
    first = choice(oa, "", None, None, delta=True, first=True)
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert choice(oa, "", "stop", None, delta=True)["delta"] == {}
    body = envelope(oa, [choice(oa, "ok", "stop", None, delta=False)], chunk=False)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "ok"
    names = _Names({1: ("\ufffd", b"\xe3"), 2: ("ab", b"ab"), 3: ("c", b"c")})
    chat_lp = ChoiceLogprobs(names, chat=True, top=0).render([1], [-0.5])["content"][0]
    assert chat_lp["logprob"] == -0.5 and chat_lp["bytes"] == [0xE3]  # the token's bytes, not U+FFFD's
    shaper = ChoiceLogprobs(names, chat=False, top=0)
    assert shaper.render([2, 3], [-1.0, -2.0])["text_offset"] == [0, 2]
    assert shaper.render([2], [-1.0])["text_offset"] == [3]  # a stream's offsets carry on


class _Names:
    def __init__(self, table: dict[int, tuple[str, bytes]]) -> None:
        self.table = table

    def token_text(self, token_id: int) -> str:
        return self.table[token_id][0]

    def token_bytes(self, token_id: int) -> bytes:
        return self.table[token_id][1]


# Out-of-range values both wire shapes can carry: (OpenAI JSON fields, SamplingParams fields, field named).
_OUT_OF_RANGE = [
    ({"temperature": 2.5}, {"temperature": 2.5}, "temperature"),
    ({"temperature": -1}, {"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, {"top_p": 1.5}, "top_p"),
    ({"top_p": -0.5}, {"top_p": -0.5}, "top_p"),
    ({"max_tokens": 0}, {"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_TOKENS + 1}, {"max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ({"stop": ["s"] * 17}, {"stop": ["s"] * 17}, "stop"),
    ({"stop": ["x" * 257]}, {"stop": ["x" * 257]}, "stop"),
    ({"stop": [""]}, {"stop": [""]}, "stop"),
]


@pytest.mark.parametrize(("http", "grpc_fields", "field"), _OUT_OF_RANGE)
def test_http_and_grpc_reject_the_same_values_the_same_way(
    http: dict[str, object], grpc_fields: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidArgument) as over_http:
        parse({"prompt": "a", **http}, False, "m", 16)
    sampling = types_pb2.SamplingParams(**{"max_tokens": 4, **grpc_fields})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as over_router:
        check_sampling_pb(sampling)
    seen = {(e.code, e.reason, e.message, e.metadata["field"]) for e in (over_http.value, over_router.value)}
    if sampling.max_tokens:  # a peer reads max_tokens 0 as "unset" (its default); the router rejects it
        with pytest.raises(SamplingError) as at_peer:
            sampling_from_pb(sampling)
        over_peer = sampling_status(at_peer.value)
        seen.add((over_peer.code, over_peer.reason, over_peer.message, over_peer.metadata["field"]))
    assert len(seen) == 1, seen
    code, reason, _, named = seen.pop()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and named == field
    assert reason == ("INVALID_MAX_TOKENS" if field == "max_tokens" else "INVALID_SAMPLING")
    # The HTTP front answers 400 with the OpenAI error shape naming the parameter.
    response = error_response(over_http.value)
    body = json.loads(response.body)  # type: ignore[arg-type]
    assert response.status == 400
    assert body["error"]["param"] == field and body["error"]["code"] == reason
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"top_k": 10**6}, "top_k"), ({"stop_token_ids": list(range(65))}, "stop_token_ids")],
)
def test_grpc_only_fields_share_the_limits(fields: dict[str, object], field: str) -> None:
    sampling = types_pb2.SamplingParams(max_tokens=4, **fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as over_router:
        check_sampling_pb(sampling)
    with pytest.raises(SamplingError) as at_peer:
        sampling_from_pb(sampling)
    assert over_router.value.metadata["field"] == at_peer.value.field == field
    assert str(over_router.value.message) == str(at_peer.value)


def test_a_huge_seed_is_a_clear_error_over_http() -> None:
    with pytest.raises(InvalidArgument) as err:
        parse({"prompt": "a", "seed": 2**64}, False, "m", 16)
    assert (err.value.reason, err.value.metadata["param"]) == ("INVALID_SAMPLING", "seed")


_CONTROLS = {
    "presence_penalty": 0.5,
    "frequency_penalty": -1.0,
    "repetition_penalty": 1.3,
    "min_tokens": 2,
    "min_p": 0.2,
    "include_stop_str_in_output": True,
}


@pytest.mark.parametrize("field", [*_CONTROLS, "logit_bias"])
def test_an_engine_that_does_not_declare_a_control_refuses_it_by_name(field: str) -> None:
    sampling = types_pb2.SamplingParams(max_tokens=4)
    if field == "logit_bias":
        sampling.logit_bias[5] = 1.0
    else:
        setattr(sampling, field, _CONTROLS[field])
    prep = Prepared("r", (1, 2), sampling, 0, "")
    with pytest.raises(InvalidArgument) as info:
        require_features(prep, types_pb2.KvLayout(), "sglang")
    assert (info.value.reason, info.value.metadata["param"]) == ("UNSUPPORTED_PARAMETER", field)
    every = types_pb2.KvLayout(features=types_pb2.EngineFeature.values()[1:])
    require_features(prep, every, "reference")  # an engine that declares them all serves it
    # The wire's off values ask for nothing: repetition_penalty 0 (unset) and 1 both pass anywhere.
    for off in (0.0, 1.0):
        require_features(
            Prepared("r", (1,), types_pb2.SamplingParams(repetition_penalty=off), 0, ""), None, "x"
        )


def test_the_grpc_and_peer_paths_check_the_controls_alike() -> None:
    bad = types_pb2.SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidArgument) as at_router:
        check_sampling_pb(bad)
    with pytest.raises(SamplingError) as at_peer:
        sampling_from_pb(bad)
    assert at_router.value.metadata["field"] == at_peer.value.field == "min_tokens"
    good = sampling_from_pb(types_pb2.SamplingParams(max_tokens=4, logit_bias={9: -3.0, 2: 1.5}))
    assert good.logit_bias == ((2, 1.5), (9, -3.0)) and good.repetition_penalty == 1.0
    assert good.adjusts_logits and not sampling_from_pb(types_pb2.SamplingParams(max_tokens=4)).adjusts_logits


def test_an_answer_too_large_for_a_message_is_a_bad_request_not_a_rate_limit() -> None:
    """A peer's MESSAGE_TOO_LARGE (RESOURCE_EXHAUSTED) is 400 over HTTP: retrying cannot help, so it is
    not the 429 of a full router."""
    err = CapacityExhausted(
        "the prefill answer is 20000000 bytes", reason="MESSAGE_TOO_LARGE", limit=16777216
    )
    response = error_response(err)
    body = json.loads(response.body)  # type: ignore[arg-type]
    assert response.status == 400 and "Retry-After" not in response.headers
    assert body["error"]["code"] == "MESSAGE_TOO_LARGE" and body["error"]["type"] == "invalid_request_error"
    full = error_response(CapacityExhausted("no slot", reason="ROUTER_OVERLOADED", retry_after_seconds=1))
    assert full.status == 429 and full.headers["Retry-After"] == "1"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_a_text_chunk_is_byte_for_byte_the_general_chunk(chat: bool, usage: bool) -> None:
    key = "messages" if chat else "prompt"
    body = {key: [{"role": "user", "content": "hi"}] if chat else "hi", "stream": True, "model": 'm"é'}
    body["stream_options"] = {"include_usage": usage}
    oa = parse(body, chat, "served", 16)
    texts = TextChunks(lambda text, index: OpenAiFront._chunk(oa, text, None, None, index))
    cases = ["hello", ' a "quote", a \\ and a\nnewline', "ünïcödé 😀", "\x00\x1f"] + ([] if chat else [""])
    for index in (0, 2):
        for text in cases:
            assert texts.chunk(text, index) == OpenAiFront._chunk(oa, text, None, None, index), (index, text)


def test_text_chunks_render_every_time_where_the_text_is_not_one_string() -> None:
    texts = TextChunks(lambda text, index: sse({"t": text.upper(), "i": index}))
    assert texts.chunk("ab", 1) == sse({"t": "AB", "i": 1})
    assert texts.chunk("cd", 1) == sse({"t": "CD", "i": 1})
