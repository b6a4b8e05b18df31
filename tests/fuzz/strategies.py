"""Hypothesis strategies of hostile OpenAI bodies and RouterService requests."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from xavier.v1 import router_service_pb2 as rpb


def fuzz(examples: int) -> settings:
    """Bounded, reproducible runs (the suite must stay well under a minute on a loaded 2-core host)."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


_SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800"])
_TEXT = st.one_of(st.text(max_size=24), _SURROGATES, st.just(""))
_HUGE = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**64, 2**70, -(2**63), 10**400])
_NUMBERS = st.one_of(
    st.integers(-3, 20),
    _HUGE,
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, 0.5, 2.0]),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXT)
_ANY = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

_GOOD: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        st.sampled_from(["Hello", "The quick brown fox", "日本語 🙂"]),
        st.lists(st.integers(0, 300), min_size=1, max_size=8),
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
                "content": st.one_of(
                    st.sampled_from(["hi", "what is 2+2?"]),
                    st.just([{"type": "text", "text": "hi"}]),
                    st.just([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
                ),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    "max_tokens": st.integers(1, 6),
    "max_completion_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2]),
    "top_p": st.sampled_from([0, 0.5, 1]),
    "top_k": st.sampled_from([-1, 0, 5]),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(st.just("\n"), st.lists(st.sampled_from(["a", "the", "."]), max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "logprobs": st.sampled_from([True, False, 0, 1, 5]),
    "top_logprobs": st.sampled_from([0, 2]),
    "n": st.sampled_from([1, 2]),
    "best_of": st.sampled_from([1, 3]),
    "echo": st.booleans(),
    "suffix": st.sampled_from(["", "x"]),
    "frequency_penalty": st.sampled_from([0, 0.5]),
    "presence_penalty": st.sampled_from([0, -1]),
    "logit_bias": st.sampled_from([{}, {"5": 10}]),
    "ignore_eos": st.booleans(),
    "xavier_mode": st.sampled_from(["pd", "colocated", "native", "warp"]),
    "user_request_id": st.text(min_size=1, max_size=140),
    "model": st.sampled_from(["", "tiny-qwen2", "gpt-4"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]),
}


@st.composite
def openai_bodies(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A body that is valid in most fields and hostile in a few (so validation is reached in depth)."""
    body: dict[str, Any] = {"messages" if chat else "prompt": draw(_GOOD["messages" if chat else "prompt"])}
    body["max_tokens"] = draw(_GOOD["max_tokens"])
    keys = draw(st.lists(st.sampled_from(sorted(_GOOD)), max_size=6, unique=True))
    for key in keys:
        body[key] = draw(st.one_of(_GOOD[key], _GOOD[key], _ANY))
    if draw(st.booleans()):
        body[draw(st.text(max_size=10))] = draw(_ANY)
    return body


def dump(body: Any) -> bytes:
    """JSON as a client would send it: lone surrogates travel as `\\ud800` escapes."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@st.composite
def mangled_bodies(draw: st.DrawFn) -> bytes:
    """Raw bytes: random, or a valid body cut, spliced with stray bytes, or nested deep."""
    base = dump({"prompt": "Hello", "max_tokens": 2})
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=256))
    if kind == 1:
        return base[: draw(st.integers(0, len(base)))]
    if kind == 2:
        at = draw(st.integers(0, len(base)))
        return base[:at] + draw(st.binary(min_size=1, max_size=8)) + base[at:]
    if kind == 3:
        depth = draw(st.integers(1, 200_000))
        return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    text = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]))
    return b'{"prompt": "' + text + b'", "max_tokens": 2}'


_U32 = st.one_of(st.integers(0, 12), st.sampled_from([2**20, 2**20 + 1, 2**32 - 1]))
_FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]))
_WIRE_TEXT = st.text(max_size=40)  # protobuf refuses lone surrogates client-side; raw bytes cover them


@st.composite
def generate_requests(draw: st.DrawFn) -> rpb.GenerateRequest:
    """A GenerateRequest with random field values, every field possibly out of range."""
    req = rpb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), _WIRE_TEXT, st.text(min_size=129, max_size=140))),
        model=draw(st.sampled_from(["", "tiny-qwen2", "other"])),
        cache_salt=draw(st.one_of(st.just(""), st.text(max_size=300))),
    )
    prompt = draw(st.integers(0, 3))
    if prompt == 0:
        req.text = draw(st.one_of(st.sampled_from(["Hello", "日本語"]), _WIRE_TEXT))
    elif prompt == 1:
        req.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 300), _U32), max_size=8)))
    elif prompt == 2:
        for role, content in draw(
            st.lists(st.tuples(st.sampled_from(["user", "bot", ""]), _WIRE_TEXT), max_size=3)
        ):
            req.chat.messages.add(role=role, content=content)
    s = req.sampling
    s.max_tokens = draw(_U32)
    s.temperature = draw(_FLOATS)
    s.top_p = draw(_FLOATS)
    s.top_k = draw(st.one_of(st.integers(0, 50), _U32))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(draw(st.lists(_WIRE_TEXT, max_size=3)))
    s.stop_token_ids.extend(draw(st.lists(_U32, max_size=3)))
    s.ignore_eos = draw(st.booleans())
    s.logprobs = draw(st.booleans())
    req.mode = draw(st.one_of(st.integers(0, 3), st.integers(4, 2**31 - 1)))  # type: ignore[assignment]
    return req


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def string_field(number: int, payload: bytes) -> bytes:
    """One length-delimited field, written by hand so its bytes need not be UTF-8."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


_BAD_UTF8 = st.sampled_from([b"\xff", b"ab\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"])


@st.composite
def raw_generate_requests(draw: st.DrawFn) -> bytes:
    """Serialized GenerateRequests with invalid UTF-8 in a string field, or random bytes."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=128))
    good = rpb.GenerateRequest(text="Hello")
    good.sampling.max_tokens = 2
    bad = draw(_BAD_UTF8)
    spot = draw(st.sampled_from(["request_id", "model", "text", "cache_salt", "role", "stop"]))
    if spot in ("request_id", "model", "text", "cache_salt"):
        number = {"request_id": 1, "model": 2, "text": 3, "cache_salt": 8}[spot]
        return good.SerializeToString() + string_field(number, bad)
    if spot == "role":
        message = string_field(1, bad) + string_field(2, b"hi")
        return string_field(5, string_field(1, message))
    sampling = _varint(1 << 3) + _varint(2) + string_field(6, bad)
    return string_field(3, b"Hello") + string_field(6, sampling)
