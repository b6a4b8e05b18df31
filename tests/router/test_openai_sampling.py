"""The sampling controls through a real `xavier up` (P/D and colocated, HTTP and gRPC): penalties,
logit_bias, min_tokens, stop_token_ids, include_stop_str_in_output, truncate_prompt_tokens, best_of,
and streams of several choices; every value out of range or not honoured is a 400 naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc

from tests.cli.mesh import Mesh
from tests.router.sse import stream_chunks

pytestmark = pytest.mark.integration
_PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]


def _post(mesh: Mesh, body: dict[str, Any], chat: bool = False) -> httpx.Response:
    path = "chat/completions" if chat else "completions"
    return httpx.post(f"http://{mesh.http}/v1/{path}", json={"model": mesh.model.name, **body}, timeout=120)


def _ok(mesh: Mesh, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    r = _post(mesh, body, chat)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _text(mesh: Mesh, body: dict[str, Any]) -> str:
    return str(_ok(mesh, body)["choices"][0]["text"])


def _greedy(**extra: Any) -> dict[str, Any]:
    return {"prompt": _PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}


_CONTROLS = [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"logit_bias": {"7": 4.0, "9": -100}, "frequency_penalty": 0.5},
]


@pytest.mark.parametrize("control", _CONTROLS, ids=["repetition", "frequency", "presence", "bias"])
def test_each_control_changes_greedy_alike_over_pd_colocated_and_grpc(
    mesh: Mesh, control: dict[str, Any]
) -> None:
    plain = _text(mesh, _greedy(xavier_mode="pd"))
    assert _text(mesh, _greedy(xavier_mode="colocated")) == plain  # without controls: unchanged
    pd = _text(mesh, _greedy(xavier_mode="pd", **control))
    assert pd != plain
    assert _text(mesh, _greedy(xavier_mode="colocated", **control)) == pd
    req = rpb.GenerateRequest(mode=rpb.ROUTING_MODE_PD)
    req.token_ids.ids.extend(_PROMPT)
    s = req.sampling
    s.max_tokens, s.ignore_eos = 16, True
    s.repetition_penalty = control.get("repetition_penalty", 0.0)
    s.frequency_penalty = control.get("frequency_penalty", 0.0)
    s.presence_penalty = control.get("presence_penalty", 0.0)
    s.logit_bias.update({int(k): float(v) for k, v in control.get("logit_bias", {}).items()})
    with grpc.insecure_channel(mesh.grpc) as channel:
        text = "".join(m.text for m in rpb_grpc.RouterServiceStub(channel).Generate(req, timeout=120))
    assert text == pd


@pytest.mark.parametrize("chat", [False, True])
def test_a_huge_logit_bias_forces_a_token(mesh: Mesh, chat: bool) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(Path(mesh.model))
    token = tok.encode(" fox", add_special_tokens=False)[0]
    prompt: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Once"}
    for mode in ("pd", "colocated"):
        body = {**prompt, "max_tokens": 6, "temperature": 1.0, "seed": 4, "xavier_mode": mode}
        out = _ok(mesh, {**body, "logit_bias": {str(token): 100}}, chat)["choices"][0]
        text = out["message"]["content"] if chat else out["text"]
        assert text == tok.decode([token] * 6)


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_min_tokens_outlasts_stop_token_ids(mesh: Mesh, mode: str) -> None:
    """A token forced by logit_bias is also a stop token id: it stops at once, and with min_tokens it
    is masked (the mask comes before the bias) until min_tokens tokens, then stops at the next."""
    body = {"prompt": _PROMPT, "max_tokens": 16, "temperature": 0, "xavier_mode": mode,
            "logit_bias": {"123": 100}, "stop_token_ids": [123]}  # fmt: skip
    stopped = _ok(mesh, body)
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == ""  # the stop token's own text is not output
    held = _ok(mesh, {**body, "min_tokens": 6})
    assert held["usage"]["completion_tokens"] == 7 and held["choices"][0]["finish_reason"] == "stop"
    assert held["choices"][0]["text"] != ""


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_include_stop_str_in_output_keeps_the_stop_string(mesh: Mesh, mode: str) -> None:
    whole = _text(mesh, _greedy(xavier_mode=mode))
    stop = whole[6:9]
    at = whole.index(stop)
    assert _text(mesh, _greedy(xavier_mode=mode, stop=[stop])) == whole[:at]
    kept = _ok(mesh, _greedy(xavier_mode=mode, stop=[stop], include_stop_str_in_output=True))["choices"][0]
    assert kept["text"] == whole[: at + len(stop)] and kept["finish_reason"] == "stop"


def test_truncate_prompt_tokens_keeps_the_last_tokens(mesh: Mesh) -> None:
    out = _ok(mesh, _greedy(truncate_prompt_tokens=5))
    assert out["usage"]["prompt_tokens"] == 5
    assert out["choices"][0]["text"] == _text(mesh, {**_greedy(), "prompt": _PROMPT[-5:]})
    assert _ok(mesh, _greedy(truncate_prompt_tokens=50))["usage"]["prompt_tokens"] == len(_PROMPT)


def test_best_of_returns_the_sequences_of_highest_cumulative_logprob(mesh: Mesh) -> None:
    body = {"prompt": _PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    scored = []
    for j in range(4):  # sequence j of a request with seed s samples with seed s + j
        one = _ok(mesh, {**body, "seed": 40 + j, "logprobs": 0})["choices"][0]
        scored.append((sum(one["logprobs"]["token_logprobs"]), one["text"]))
    ranked = [text for _, text in sorted(scored, reverse=True)]
    assert len(set(ranked)) > 1
    best = _ok(mesh, {**body, "seed": 40, "best_of": 4})
    assert [c["text"] for c in best["choices"]] == ranked[:1]
    assert best["choices"][0]["logprobs"] is None  # asked for none: the ranking's logprobs stay inside
    assert best["usage"]["completion_tokens"] == 4 * 8  # every sequence sampled counts
    two = _ok(mesh, {**body, "seed": 40, "best_of": 4, "n": 2, "logprobs": 0})
    assert [c["text"] for c in two["choices"]] == ranked[:2]
    assert [c["index"] for c in two["choices"]] == [0, 1]


@pytest.mark.parametrize("chat", [False, True])
def test_streams_of_several_choices_carry_each_choices_index(mesh: Mesh, chat: bool) -> None:
    body: dict[str, Any] = {"max_tokens": 6, "temperature": 1.0, "seed": 8, "ignore_eos": True, "n": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": ["Once", "Twice"]})
    whole = _ok(mesh, body, chat)
    path = "chat/completions" if chat else "completions"
    chunks = stream_chunks(mesh, path, {**body, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (c,) = chunk["choices"]
        if chat and c["index"] not in texts:
            assert c["delta"] == {"role": "assistant", "content": ""}  # each choice's role comes first
        piece = (c["delta"].get("content") or "") if chat else c["text"]
        texts[c["index"]] = texts.get(c["index"], "") + piece
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    expected = {c["index"]: c["message"]["content"] if chat else c["text"] for c in whole["choices"]}
    assert texts == expected and len(expected) == (2 if chat else 4)
    assert finishes == {i: "length" for i in expected}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage is not None
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == whole["usage"][key]


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "INVALID_SAMPLING"),
        ({"frequency_penalty": "x"}, "frequency_penalty", "INVALID_SAMPLING"),
        ({"repetition_penalty": 0}, "repetition_penalty", "INVALID_SAMPLING"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "INVALID_SAMPLING"),
        ({"logit_bias": {"ab": 1}}, "logit_bias", "INVALID_SAMPLING"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "INVALID_SAMPLING"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "INVALID_SAMPLING"),
        ({"min_p": 1.5}, "min_p", "INVALID_SAMPLING"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "INVALID_SAMPLING"),
        ({"best_of": 1, "n": 2}, "best_of", "INVALID_SAMPLING"),
        ({"best_of": 2, "stream": True}, "best_of", "UNSUPPORTED_PARAMETER"),
        ({"min_tokens": 2, "guided_regex": "a+"}, "min_tokens", "UNSUPPORTED_PARAMETER"),
        ({"typical_p": 0.5}, "typical_p", "UNSUPPORTED_PARAMETER"),
        ({"bad_words": ["x"]}, "bad_words", "UNSUPPORTED_PARAMETER"),
        ({"allowed_token_ids": [1]}, "allowed_token_ids", "UNSUPPORTED_PARAMETER"),
        ({"use_beam_search": True}, "use_beam_search", "UNSUPPORTED_PARAMETER"),
        ({"skip_special_tokens": False}, "skip_special_tokens", "UNSUPPORTED_PARAMETER"),
        ({"length_penalty": 2.0}, "length_penalty", "UNSUPPORTED_PARAMETER"),
    ],
)
def test_bad_or_unhonoured_values_are_400_naming_the_parameter(
    mesh: Mesh, extra: dict[str, Any], param: str, code: str
) -> None:
    r = _post(mesh, {"prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert "Traceback" not in error["message"] and "/" not in error["message"]
