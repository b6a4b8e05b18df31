"""Tool calls streamed as they are written (`router/tool_stream.py`): however an answer's text is cut
into pieces, the events are the same, the content before a call streams before the call ends, a call
starts once its name is known and its arguments follow in fragments, and a stream accumulated the way
OpenAI clients do (the openai SDK's `ChatCompletionStreamState`, LangChain's and litellm's merges: per
`index`, the first entry's id, type and name, the arguments concatenated) is the unstreamed answer."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from xavier_services.router.openai_tools import tool_message, tool_parser, tool_plan
from xavier_services.router.tool_stream import CallArgs, CallStart, Content, ToolEvent, delta_of, merged

_ARGS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
_TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": _ARGS}},
    {"type": "function", "function": {"name": "now"}},
]
_NAMED = {"type": "function", "function": {"name": "search"}}
# (tool_choice, answer): calls in every form, text around them, strings holding brackets, quotes and
# tags, a call whose arguments come before its name, one with none, one naming no tool.
_ANSWERS: list[tuple[Any, str]] = [
    (None, 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "o}s{l\\"o"}}\n</tool_call>\n'
     '<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
    (None, 'A < B, and <tool_call>{"arguments": {"q": "[x]"}, "name": "search"}</tool_call> then more  \n'),
    (None, '<tool_call>{"name": "now"}</tool_call>\n\nDone.'),
    (None, '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"s\\"}"}</tool_call>'),
    (None, 'x <tool_call>{"name": "other", "arguments": {}}</tool_call> y <tool_call'),
    (None, 'a tag in text: "</tool_call>" and '
     '<tool_call>{"name":"search","arguments":{"q":"</tool"}}</tool_call>'),
    ("required", '[{"name": "search", "parameters": {"q": "a, b"}}, {"name": "now", "parameters": {}}]'),
    ("required", '[{"name": "now", "parameters": {"deep": [1, {"k": "}"}]}}]'),
    (_NAMED, '{"q": "x y z"}'),
]  # fmt: skip


def _plan(choice: Any) -> Any:
    return tool_plan({"tools": _TOOLS, **({"tool_choice": choice} if choice is not None else {})})


def _events(choice: Any, pieces: list[str]) -> list[list[ToolEvent]]:
    parser = tool_parser(_plan(choice))
    return [*(parser.feed(p) for p in pieces), parser.end()]


def _pieces(text: str, cuts: list[int]) -> list[str]:
    at = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


def _plain(events: list[list[ToolEvent]]) -> list[ToolEvent]:
    """The events with the call ids blanked and adjacent text and fragments joined (cut-independent)."""
    flat = [
        CallStart(e.index, "", e.name) if isinstance(e, CallStart) else e for step in events for e in step
    ]
    return merged(flat)


def _accumulate(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed message as OpenAI clients rebuild it from its deltas."""
    content, calls = "", dict[int, dict[str, Any]]()
    for delta in deltas:
        content += delta.get("content") or ""
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(
                entry["index"], {"id": "", "type": "", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = entry.get("id") or call["id"]
            call["type"] = entry.get("type") or call["type"]
            fn = entry.get("function", {})
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(case=st.sampled_from(range(len(_ANSWERS))), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_the_events_do_not_depend_on_how_the_text_is_cut(case: int, cuts: list[int]) -> None:
    choice, text = _ANSWERS[case]
    assert _plain(_events(choice, _pieces(text, cuts))) == _plain(_events(choice, [text]))


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(case=st.sampled_from(range(len(_ANSWERS))), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_an_accumulated_stream_is_the_unstreamed_answer(case: int, cuts: list[int]) -> None:
    choice, text = _ANSWERS[case]
    message, finish = tool_message(_plan(choice), text, "stop")
    deltas = [delta_of(e) for step in _events(choice, _pieces(text, cuts)) for e in step]
    got = _accumulate(deltas)
    assert got["content"] == message["content"]
    want = message.get("tool_calls", [])
    assert [c["function"] for c in got["tool_calls"]] == [c["function"] for c in want]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got["tool_calls"])
    assert finish == ("tool_calls" if want else "stop")
    for call in want:  # arguments are the model's own JSON text
        json.loads(call["function"]["arguments"])


def test_what_is_held_back_and_what_streams_at_once() -> None:
    parser = tool_parser(_plan(None))
    assert parser.feed("Hello <tool") == [Content("Hello")]  # a possible tag start is held
    assert parser.feed("_call>") == []
    assert parser.feed('{"name": "sea') == []  # a call waits for its whole name
    start, first = parser.feed('rch", "arguments": {"q"')  # then its arguments, as they come
    assert isinstance(start, CallStart) and start.name == "search" and first == CallArgs(0, '{"q"')
    assert parser.feed(': "os') == [CallArgs(0, ': "os')]
    assert parser.feed('lo"}') == [CallArgs(0, 'lo"}')]
    assert parser.feed("}</tool_call>  ") == []
    assert parser.end() == [] and parser.calls == 1
    # The first entry of a call in a chunk: id, type and name, arguments empty; then fragments alone.
    assert delta_of(start) == {"tool_calls": [{"index": 0, "id": start.id, "type": "function",
                                               "function": {"name": "search", "arguments": ""}}]}  # fmt: skip
    assert delta_of(CallArgs(0, "{")) == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}


def test_a_named_choice_starts_its_call_before_any_token() -> None:
    parser = tool_parser(_plan(_NAMED))
    (start, args) = parser.feed('{"q"')
    assert isinstance(start, CallStart) and start.name == "search" and args == CallArgs(0, '{"q"')
    assert parser.feed(': "x"}') == [CallArgs(0, ': "x"}')] and parser.end() == []
