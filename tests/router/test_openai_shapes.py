"""OpenAI request parsing and SSE framing."""

from __future__ import annotations

import json

import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier_services.router.openai_shapes import choice, envelope, logprobs_json, parse, sse

from xavier_core.runtime import InvalidArgument


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


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": "a", "n": 3}, "UNSUPPORTED_N"),
        ({"prompt": ["a", "b"]}, "INVALID_PROMPT"),
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


def test_chat_shapes() -> None:
    oa = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True, "m", 16)
    assert oa.request.chat.messages[0].content == "hi"
    first = choice(oa, "", None, None, delta=True, first=True)
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert choice(oa, "", "stop", None, delta=True)["delta"] == {}
    body = envelope(oa, [choice(oa, "ok", "stop", None, delta=False)], chunk=False)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "ok"
    assert logprobs_json(True, ["a"], [-0.5])["content"][0]["logprob"] == -0.5
    assert logprobs_json(False, ["ab", "c"], [-1.0, -2.0])["text_offset"] == [0, 2]
