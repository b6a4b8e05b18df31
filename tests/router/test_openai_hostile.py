"""Hostile HTTP bodies: each is a 400 naming the field, decided before anything reaches protobuf."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier_services.router.openai_body import MAX_DEPTH, decode_json
from xavier_services.router.openai_shapes import parse
from xavier_services.router.prompts import ModelInfo
from xavier_services.router.request import prepare

from tests.cli.mesh import Mesh
from xavier_core.runtime import InvalidArgument

_RAW = [
    (b"", "INVALID_JSON"),
    (b"  \n", "INVALID_JSON"),
    (b"{", "INVALID_JSON"),
    (b"\xff\xfe{}", "INVALID_JSON"),
    (b"[1, 2]", "INVALID_JSON"),
    (b'"text"', "INVALID_JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "INVALID_JSON"),
    (b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), "INVALID_JSON"),
    (b'{"prompt": "\\ud800"}', "INVALID_ARGUMENT"),
    (b'{"\\udfff": 1}', "INVALID_ARGUMENT"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "INVALID_JSON"),
]


@pytest.mark.parametrize(("raw", "reason"), _RAW)
def test_raw_bodies_are_refused_with_a_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        decode_json(raw)
    assert err.value.reason == reason


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "\ud800"}, "prompt"),
        ({"messages": [{"role": "user", "content": "\ud800x"}]}, "messages[0].content"),
        ({"prompt": "a", "stop": ["ok", "\udc00"]}, "stop[1]"),
        ({"prompt": "a", "model": "m\ud800"}, "model"),
    ],
)
def test_lone_surrogates_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        decode_json(json.dumps(body).encode())
    assert err.value.metadata["param"] == param


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({"prompt": "a", "max_tokens": 2**70}, "max_tokens", "INVALID_MAX_TOKENS"),
        ({"prompt": [1, 2**64]}, "prompt", "INVALID_TOKEN_ID"),
        ({"prompt": [1, -1]}, "prompt", "INVALID_TOKEN_ID"),
        ({"prompt": [True, 2]}, "prompt", "INVALID_TOKEN_ID"),
        ({"prompt": "a", "stream": "false"}, "stream", "INVALID_ARGUMENT"),
        ({"prompt": "a", "stream": 1}, "stream", "INVALID_ARGUMENT"),
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos", "INVALID_ARGUMENT"),
        ({"prompt": "a", "stream_options": []}, "stream_options", "INVALID_ARGUMENT"),
        (
            {"prompt": "a", "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "INVALID_ARGUMENT",
        ),
        ({"prompt": "a", "temperature": "0.5"}, "temperature", "INVALID_SAMPLING"),
        ({"prompt": "a", "temperature": True}, "temperature", "INVALID_SAMPLING"),
        ({"prompt": "a", "temperature": 1e400}, "temperature", "INVALID_SAMPLING"),
        ({"prompt": "a", "top_p": 0}, "top_p", "INVALID_SAMPLING"),
        ({"prompt": "a", "seed": 1.5}, "seed", "INVALID_SAMPLING"),
        ({"prompt": "a", "seed": -1}, "seed", "INVALID_SAMPLING"),
        ({"prompt": "a", "model": 3}, "model", "INVALID_ARGUMENT"),
        ({"prompt": "a", "n": "2"}, "n", "UNSUPPORTED_N"),
        ({"prompt": "a", "n": 0}, "n", "UNSUPPORTED_N"),
        ({"prompt": "a", "best_of": 2, "stream": True}, "best_of", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "best_of": "2"}, "best_of", "INVALID_SAMPLING"),
        ({"prompt": "a", "logprobs": 21}, "logprobs", "INVALID_ARGUMENT"),
        ({"prompt": "a", "logprobs": "5"}, "logprobs", "INVALID_ARGUMENT"),
        # Honoured controls (openai_sampling): only values of the wrong type or range are refused.
        ({"prompt": "a", "frequency_penalty": 2.5}, "frequency_penalty", "INVALID_SAMPLING"),
        ({"prompt": "a", "presence_penalty": "1"}, "presence_penalty", "INVALID_SAMPLING"),
        ({"prompt": "a", "repetition_penalty": -1}, "repetition_penalty", "INVALID_SAMPLING"),
        ({"prompt": "a", "logit_bias": {"5": "10"}}, "logit_bias", "INVALID_SAMPLING"),
        ({"prompt": "a", "logit_bias": [5]}, "logit_bias", "INVALID_SAMPLING"),
        ({"prompt": "a", "logit_bias": {"-5": 1}}, "logit_bias", "INVALID_SAMPLING"),
        ({"prompt": "a", "echo": 1}, "echo", "INVALID_ARGUMENT"),
        # Extensions no engine honours yet: refused, never silently ignored.
        ({"prompt": "a", "min_tokens": 17}, "min_tokens", "INVALID_SAMPLING"),  # above max_tokens 16
        ({"prompt": "a", "min_tokens": 1.5}, "min_tokens", "INVALID_SAMPLING"),
        ({"prompt": "a", "min_p": -0.1}, "min_p", "INVALID_SAMPLING"),
        ({"prompt": "a", "typical_p": 0.5}, "typical_p", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "use_beam_search": True}, "use_beam_search", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "logits_processors": ["x"]}, "logits_processors", "UNSUPPORTED_PARAMETER"),
        # vLLM's guided_json / guided_regex are honoured (openai_grammar): only bad values are refused.
        ({"prompt": "a", "guided_json": 5}, "guided_json", "INVALID_GRAMMAR"),
        ({"prompt": "a", "guided_regex": ["a+"]}, "guided_regex", "INVALID_GRAMMAR"),
        ({"prompt": "a", "guided_choice": ["a"]}, "guided_choice", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "structured_outputs": {"json": {}}}, "structured_outputs", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "bad_words": ["x"]}, "bad_words", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "allowed_token_ids": [1, 2]}, "allowed_token_ids", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "prompt_logprobs": 1}, "prompt_logprobs", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "truncate_prompt_tokens": -1}, "truncate_prompt_tokens", "INVALID_SAMPLING"),
        ({"prompt": "a", "include_stop_str_in_output": 1}, "include_stop_str_in_output", "INVALID_ARGUMENT"),
        ({"prompt": "a", "tool_choice": "required"}, "tool_choice", "UNSUPPORTED_PARAMETER"),
        ({"prompt": "a", "modalities": ["text", "audio"]}, "modalities", "UNSUPPORTED_PARAMETER"),
        (
            {"prompt": "a", "prediction": {"type": "content", "content": "x"}},
            "prediction",
            "UNSUPPORTED_PARAMETER",
        ),
        ({"prompt": "a", "stop_token_ids": [1, "2"]}, "stop_token_ids", "INVALID_SAMPLING"),
        ({"prompt": "a", "stop_token_ids": 5}, "stop_token_ids", "INVALID_SAMPLING"),
        ({"prompt": "a", "xavier_mode": 1}, "xavier_mode", "INVALID_ARGUMENT"),
        ({"prompt": "a", "user_request_id": ["x"]}, "user_request_id", "INVALID_ARGUMENT"),
    ],
)
def test_completion_fields_are_typed_and_named(body: dict[str, object], param: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse(body, False, "m", 16)
    assert (err.value.metadata.get("param"), err.value.reason) == (param, reason)


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "INVALID_ARGUMENT"),
        ({"top_logprobs": 3}, "top_logprobs", "INVALID_ARGUMENT"),  # alternatives need logprobs: true
        ({"echo": True}, "echo", "UNSUPPORTED_PARAMETER"),
        ({"logprobs": "true"}, "logprobs", "INVALID_ARGUMENT"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
            "UNSUPPORTED_PARAMETER",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "INVALID_CHAT"),
        ({"messages": [{"role": 5, "content": "a"}]}, "messages[0].role", "INVALID_CHAT"),
        ({"messages": "hi"}, "messages", "EMPTY_PROMPT"),
        ({"tools": [{"type": "function"}]}, "tools[0].function.name", "INVALID_ARGUMENT"),
        ({"tools": {"type": "function"}}, "tools", "INVALID_ARGUMENT"),
        ({"tool_choice": "required"}, "tool_choice", "INVALID_ARGUMENT"),  # needs tools
    ],
)
def test_chat_fields_are_typed_and_named(body: dict[str, object], param: str, reason: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(InvalidArgument) as err:
        parse(body, True, "m", 16)
    assert (err.value.metadata.get("param"), err.value.reason) == (param, reason)


def test_no_op_values_clients_send_by_default_are_accepted() -> None:
    body = {
        "prompt": "a",
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "logprobs": 0,
        "n": 1,
        "best_of": 1,
        "echo": False,
        "stream": False,
        "stream_options": None,
        "top_k": -1,
    }
    oa = parse(body, False, "m", 16)
    assert oa.logprobs and not oa.stream and oa.request.sampling.top_k == 0
    chat = parse({"messages": [{"role": "user", "content": None}], "top_logprobs": 0}, True, "m", 16)
    assert chat.request.chat.messages[0].content == ""


def test_grpc_mode_out_of_the_enum_is_invalid_argument() -> None:
    req = rpb.GenerateRequest(mode=99)  # type: ignore[arg-type]  # proto3 enums are open on the wire
    req.token_ids.ids.extend([1, 2])
    req.sampling.max_tokens = 2
    model = ModelInfo(name="m", max_context=64, vocab_size=100, tokenizer_fingerprint="")
    with pytest.raises(InvalidArgument) as err:
        prepare(req, None, model)  # type: ignore[arg-type]  # token ids need no encoder
    assert (err.value.reason, err.value.metadata["field"]) == ("INVALID_MODE", "mode")


# The cases over real HTTP: (raw body, the field the 400 names or None for body-level errors).
_OVER_HTTP = [
    (b"{not json", None),
    (b"", None),
    (b'{"prompt": "\xff\xfe"}', None),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (b'{"prompt": "a", "stop": "\\ud800"}', "stop"),
    (b'{"prompt": "a", "model": "\\ud800"}', "model"),
    (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    (b'{"prompt": "a", "max_tokens": 1180591620717411303424}', "max_tokens"),
    (b'{"prompt": [1, 18446744073709551616]}', "prompt"),
    (b'{"prompt": "a", "stream": "false"}', "stream"),
    (b'{"prompt": "a", "top_p": 0}', "top_p"),
    (b'{"prompt": "a", "logprobs": 50}', "logprobs"),
    (
        b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 21}',
        "top_logprobs",
    ),
    (b'{"prompt": "a", "frequency_penalty": 3.0}', "frequency_penalty"),
    (b'{"prompt": "a", "presence_penalty": -2.5}', "presence_penalty"),
    (b'{"prompt": "a", "logit_bias": {"1": 500}}', "logit_bias"),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        "messages[0].content[0].type",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(("raw", "param"), _OVER_HTTP)
def test_the_reported_bodies_are_400_naming_the_field(mesh: Mesh, raw: bytes, param: str | None) -> None:
    path = "/v1/chat/completions" if raw.startswith(b'{"messages"') else "/v1/completions"
    request = urllib.request.Request(
        f"http://{mesh.http}{path}", data=raw, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400
    assert info.value.headers["Content-Type"].startswith("application/json")
    err = json.loads(info.value.read())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_no_op_values_of_refused_extensions_pass() -> None:
    """What clients send by default asks for nothing and is accepted."""
    body = {"prompt": "a", "min_tokens": 0, "min_p": 0.0, "typical_p": 1.0, "tool_choice": "none",
            "modalities": ["text"], "include_stop_str_in_output": False, "guided_json": None,
            "bad_words": []}  # fmt: skip
    oa = parse(body, False, "m", 16)
    assert oa.request.sampling.max_tokens == 16
    assert list(
        parse({"prompt": "a", "stop_token_ids": [7, 9]}, False, "m", 16).request.sampling.stop_token_ids
    ) == [7, 9]


@pytest.mark.integration
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "x-unknown"])
def test_a_body_that_is_not_in_its_content_encoding_is_400(mesh: Mesh, encoding: str) -> None:
    request = urllib.request.Request(
        f"http://{mesh.http}/v1/completions",
        data=b'{"prompt": "a"}',  # not compressed at all
        headers={"Content-Type": "application/json", "Content-Encoding": encoding},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400
    err = json.loads(info.value.read())["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "INVALID_JSON", err
