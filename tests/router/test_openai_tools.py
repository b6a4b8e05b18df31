"""Tool plans and tool-call parsing on the OpenAI front (no mesh): what each tool_choice forces, and how
answers become `tool_calls`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from xavier_services.router.openai_tools import tool_message, tool_plan

from xavier_core.grammar import GrammarKind

_ARGS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
_TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": _ARGS}},
    {"type": "function", "function": {"name": "now"}},
]


def _plan(choice: Any = None, **extra: Any) -> Any:
    plan = tool_plan({"tools": _TOOLS, **({"tool_choice": choice} if choice is not None else {}), **extra})
    assert plan is not None
    return plan


def test_auto_parses_calls_in_the_hermes_form_and_keeps_the_text_beside_them() -> None:
    plan = _plan()
    assert (
        plan.choice == "auto" and plan.grammar is None and [t.name for t in plan.tools] == ["search", "now"]
    )
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "oslo"}}\n</tool_call>\n' \
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'  # fmt: skip
    message, finish = tool_message(plan, text, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me look."
    names = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert names == [("search", {"q": "oslo"}), ("now", {})]
    assert len({c["id"] for c in message["tool_calls"]}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"search": 1}</tool_call>',  # no name
        "<tool_call>plain words</tool_call>",  # not a JSON object
    ],
)
def test_auto_leaves_text_without_a_valid_call_alone(text: str) -> None:
    assert tool_message(_plan(), text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_a_block_naming_a_tool_is_a_call_as_far_as_it_came() -> None:
    # A stream sends the call once its name is known, so the whole answer says the same.
    message, finish = tool_message(_plan(), '<tool_call>{"name": "search", "arguments": </tool_call>', "stop")
    assert finish == "tool_calls" and message["tool_calls"][0]["function"] == {
        "name": "search",
        "arguments": "{}",
    }


def test_a_cut_off_answer_stays_text() -> None:
    plan = _plan({"type": "function", "function": {"name": "search"}})
    assert tool_message(plan, '{"q": "os', "length") == (
        {"role": "assistant", "content": '{"q": "os'},
        "length",
    )


def test_named_forces_the_functions_arguments() -> None:
    plan = _plan({"type": "function", "function": {"name": "search"}})
    assert plan.grammar.kind is GrammarKind.JSON_SCHEMA and json.loads(plan.grammar.text) == _ARGS
    message, finish = tool_message(plan, '{"q": "x"}', "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"q": "x"}'}


@pytest.mark.parametrize(("parallel", "max_items"), [(None, None), (True, None), (False, 1)])
def test_required_forces_an_array_of_calls(parallel: bool | None, max_items: int | None) -> None:
    plan = _plan("required", **({"parallel_tool_calls": parallel} if parallel is not None else {}))
    schema = json.loads(plan.grammar.text)
    assert schema["minItems"] == 1 and schema.get("maxItems") == max_items
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["search"], ["now"]]
    text = '[{"name": "now", "parameters": {}}, {"name": "search", "parameters": {"q": "a"}}]'
    message, finish = tool_message(plan, text, "stop")
    assert finish == "tool_calls"
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ["{}", '{"q": "a"}']


def test_none_renders_the_tools_and_parses_nothing() -> None:
    plan = _plan("none")
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert len(plan.tools) == 2 and tool_message(plan, text, "stop")[0]["content"] == text
    assert tool_plan({"tool_choice": "none"}) is None and tool_plan({"tools": []}) is None
