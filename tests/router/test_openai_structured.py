"""Structured output and tools through a real `xavier up` (P/D and colocated, reference engines on a
random-weight checkpoint): every output under a schema parses and validates, json_object gives an
object, a regex is matched, forced tool calls come back as `tool_calls`, bad grammars get a 400 naming
the parameter, and the chat template renders the tools."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc

from tests.cli.mesh import Mesh
from tests.router.sse import stream_chunks
from tests.router.structured_schemas import errors, schemas

pytestmark = pytest.mark.integration
_HI = [{"role": "user", "content": "Tell me about the weather."}]
_WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": _WEATHER},
    },
    {"type": "function", "function": {"name": "no_args"}},
]


def _post(mesh: Mesh, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"http://{mesh.http}/v1/{path}", json={"model": mesh.model.name, **body}, timeout=120)


def _ok(mesh: Mesh, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = _post(mesh, path, body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()["choices"][0]
    return out


def _answer(choice: dict[str, Any]) -> str:
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


@settings(
    max_examples=100, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(schema=schemas(), chat=st.booleans(), mode=st.sampled_from(["pd", "colocated"]), hot=st.booleans())
def test_every_output_under_a_schema_validates(
    mesh: Mesh, schema: dict[str, Any], chat: bool, mode: str, hot: bool
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    body: dict[str, Any] = {"response_format": fmt, "max_tokens": 400, "xavier_mode": mode}
    body.update({"temperature": 1.0, "seed": 7} if hot else {"temperature": 0})
    body.update({"messages": _HI} if chat else {"prompt": "Once upon a time"})
    choice = _ok(mesh, "chat/completions" if chat else "completions", body)
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(_answer(choice))
    assert errors(value, schema) == [], (schema, value)


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_json_object_gives_an_object_and_plain_greedy_is_unchanged(mesh: Mesh, mode: str) -> None:
    prompt = [5, 6, 7, 8]
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "xavier_mode": mode}
    choice = _ok(mesh, "completions", {**body, "response_format": {"type": "json_object"}})
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict)
    # `text` asks for nothing; the same request without a grammar answers what it answers anyway.
    plain = _ok(mesh, "completions", {**body, "max_tokens": 12, "ignore_eos": True})
    again = _ok(
        mesh,
        "completions",
        {**body, "max_tokens": 12, "ignore_eos": True, "response_format": {"type": "text"}},
    )
    assert plain["text"] == again["text"]
    with pytest.raises(ValueError):
        json.loads(plain["text"])  # the model alone writes no JSON


def test_guided_regex_is_matched(mesh: Mesh) -> None:
    pattern = r"(yes|no) \((low|high)\): [0-9]{2,4}"
    for mode in ("pd", "colocated"):
        choice = _ok(
            mesh,
            "completions",
            {"prompt": "Answer:", "guided_regex": pattern, "max_tokens": 50, "xavier_mode": mode},
        )
        assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, choice["text"]), choice


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_a_named_tool_choice_returns_a_valid_call(mesh: Mesh, mode: str) -> None:
    body = {"messages": _HI, "tools": _TOOLS, "max_tokens": 200, "xavier_mode": mode,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    choice = _ok(mesh, "chat/completions", body)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7 and len(args["city"]) <= 8
    assert choice["message"]["content"] is None


def _stream(mesh: Mesh, body: dict[str, Any]) -> list[dict[str, Any]]:
    return stream_chunks(mesh, "chat/completions", body)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_are_the_whole_answers(mesh: Mesh, tool_choice: object) -> None:
    body = {"messages": _HI, "tools": _TOOLS, "tool_choice": tool_choice, "max_tokens": 300, "temperature": 0}
    whole = _ok(mesh, "chat/completions", body)
    chunks = _stream(mesh, {**body, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    entries = [
        c for chunk in chunks if chunk["choices"] for c in chunk["choices"][0]["delta"].get("tool_calls", [])
    ]
    # OpenAI's shape: a call's first entry has its id, type and name with empty arguments; the
    # arguments follow in fragments, in order, and (accumulated per index) are the unstreamed answer's.
    firsts = [e for e in entries if "id" in e]
    assert [e["index"] for e in firsts] == list(range(len(whole["message"]["tool_calls"])))
    assert all(e["type"] == "function" and e["function"]["arguments"] == "" for e in firsts)
    assert all(
        set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
        for e in entries
        if "id" not in e
    )
    calls = [{"name": e["function"]["name"], "arguments": ""} for e in firsts]
    for e in entries:
        calls[e["index"]]["arguments"] += e["function"]["arguments"]
    assert calls == [c["function"] for c in whole["message"]["tool_calls"]]
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
    assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_streamed_auto_tool_choice_sends_the_text(mesh: Mesh) -> None:
    body = {"messages": _HI, "tools": _TOOLS, "max_tokens": 12, "temperature": 0}
    whole = _ok(mesh, "chat/completions", body)
    chunks = _stream(mesh, body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert "<tool_call>" not in text  # the random model writes no call: its text comes back
    assert (
        text == whole["message"]["content"]
        and whole["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"]
    )


def test_required_tool_choice_calls_some_tool(mesh: Mesh) -> None:
    body = {"messages": _HI, "tools": _TOOLS, "tool_choice": "required", "max_tokens": 300, "temperature": 0,
            "parallel_tool_calls": False}  # fmt: skip
    choice = _ok(mesh, "chat/completions", body)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]  # parallel_tool_calls false: exactly one
    assert call["function"]["name"] in ("get_weather", "no_args")
    if call["function"]["name"] == "get_weather":
        assert errors(json.loads(call["function"]["arguments"]), {**_WEATHER}) == []
    else:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_the_chat_template_renders_the_tools(mesh: Mesh) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(Path(mesh.model))
    call = {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    history = [*_HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]  # fmt: skip
    counts = []
    for messages, tools in ((_HI, None), (_HI, _TOOLS), (history, _TOOLS)):
        body = {
            "messages": messages,
            "max_tokens": 1,
            "tool_choice": "none",
            **({"tools": tools} if tools else {}),
        }
        r = _post(mesh, "chat/completions", body)
        assert r.status_code == 200, r.text
        hf_messages = [{**m, "content": m["content"] or ""} for m in messages]
        for m in hf_messages:
            for c in m.get("tool_calls", []):
                c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
        text = tok.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        counts.append(len(ids))
    assert counts[0] < counts[1] < counts[2]  # the tools, then the call and its answer, are rendered


def _schema(schema: object) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _tool_of(function: dict[str, Any]) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": function}]}


_CHAT, _COMPLETIONS = "chat/completions", "completions"
_NAMED_OTHER = {"type": "function", "function": {"name": "other"}}
_BAD = [
    (_CHAT, _schema({"type": "nope"}), "response_format", "INVALID_GRAMMAR"),
    (_COMPLETIONS, _schema({"properties": {"a": {"$ref": "#/x"}}}), "response_format", "INVALID_GRAMMAR"),
    (_CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "INVALID_GRAMMAR"),
    (_CHAT, {"response_format": {"type": "yaml"}}, "response_format", "INVALID_GRAMMAR"),
    (_COMPLETIONS, {"guided_regex": "(("}, "guided_regex", "INVALID_GRAMMAR"),
    (_COMPLETIONS, {"guided_json": "{not json"}, "guided_json", "INVALID_GRAMMAR"),
    (_COMPLETIONS, {"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex",
     "UNSUPPORTED_PARAMETER"),
    (_COMPLETIONS, {"guided_choice": ["a", "b"]}, "guided_choice", "UNSUPPORTED_PARAMETER"),
    (_COMPLETIONS, {"structured_outputs": {"json": {}}}, "structured_outputs", "UNSUPPORTED_PARAMETER"),
    (_COMPLETIONS, {"tools": _TOOLS}, "tools", "UNSUPPORTED_PARAMETER"),
    (_CHAT, _tool_of({"name": "f", "parameters": {"type": "nope"}}), "tools[0].function.parameters",
     "INVALID_GRAMMAR"),
    (_CHAT, _tool_of({"name": "bad name"}), "tools[0].function.name", "INVALID_ARGUMENT"),
    (_CHAT, {"tools": _TOOLS, "tool_choice": _NAMED_OTHER}, "tool_choice", "INVALID_ARGUMENT"),
    (_CHAT, {"tool_choice": "required"}, "tool_choice", "INVALID_ARGUMENT"),
    (_CHAT, {"tools": _TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "UNSUPPORTED_PARAMETER"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "code"), _BAD)
def test_bad_grammars_and_tools_get_a_400_naming_the_parameter(
    mesh: Mesh, path: str, body: dict[str, Any], param: str, code: str
) -> None:
    prompt = {"messages": _HI} if path.startswith("chat") else {"prompt": "hi"}
    r = _post(mesh, path, {**prompt, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert ".cc:" not in error["message"] and "/project/" not in error["message"]


def test_grpc_carries_the_grammar_and_refuses_a_bad_one(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.grpc) as channel:
        stub = rpb_grpc.RouterServiceStub(channel)
        req = rpb.GenerateRequest(text="Once upon a time", mode=rpb.ROUTING_MODE_PD)
        req.sampling.max_tokens = 200
        req.sampling.json_schema = json.dumps(_WEATHER)
        text = "".join(m.text for m in stub.Generate(req, timeout=120))
        assert errors(json.loads(text), _WEATHER) == []
        req.sampling.regex = "(("
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(info.value)
    assert status is not None
    detail = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(detail)
    assert detail.reason == "INVALID_GRAMMAR" and detail.metadata["field"] == "regex"
