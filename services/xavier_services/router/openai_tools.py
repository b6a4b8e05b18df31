"""Tools on the OpenAI chat front: `tools`, `tool_choice`, `parallel_tool_calls`, and `tool_calls` out.

The chat template renders the tools (`ChatPrompt.tools`). What the model may answer depends on
`tool_choice`:

- "none": text; nothing is parsed.
- "auto" (the default with tools): text, from which calls written in Qwen2.5's (Hermes') form,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, are parsed into `tool_calls`.
- "required": a grammar (a JSON schema) makes the answer a JSON array of at least one call,
  `[{"name": ..., "parameters": {...}}]`, each naming a tool and following its parameters' schema (at
  most one call when `parallel_tool_calls` is false).
- a named function: a grammar makes the answer that function's arguments (its parameters' schema).

The forced forms are vLLM's; either way the client gets OpenAI's `message.tool_calls` and
`finish_reason: "tool_calls"` once the answer ended on its own (a cut-off answer stays text). A stream
sends the calls as they are written (`tool_stream`): a first `delta.tool_calls` entry with the call's id
and name, then fragments of its arguments, whose concatenation is the unstreamed answer's; a stream cut
off keeps what it sent and ends with `finish_reason: "length"`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xavier.v1 import router_service_pb2 as rpb

from xavier_core.grammar import GrammarKind, GrammarSpec
from xavier_core.runtime import InvalidArgument
from xavier_services.router.chat_tools import MAX_TOOLS, TOOL_NAME
from xavier_services.router.openai_grammar import checked, schema_text
from xavier_services.router.tool_stream import ToolCalls, assemble

_ANY_OBJECT = {"type": "object"}


def _bad(param: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, reason="INVALID_ARGUMENT", param=param)


@dataclass(frozen=True)
class ToolPlan:
    """A chat's tools and what its answer may be."""

    tools: tuple[rpb.ChatTool, ...]
    choice: str  # "none", "auto", "required" or "named"
    named: str = ""  # the function of a named choice
    grammar: GrammarSpec | None = None  # what "required" and named force
    schemas: dict[str, Any] = field(default_factory=dict)  # name -> parameters schema

    @property
    def forced(self) -> bool:
        return self.grammar is not None


def _tool(i: int, value: Any) -> tuple[rpb.ChatTool, Any]:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise _bad(where, f"{where} must be an object of type function")
    fn = value.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
        raise _bad(
            f"{where}.function.name", "a function name is 1 to 64 characters of a-z, A-Z, 0-9, _ and -"
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description", "a function description must be a string")
    params = fn.get("parameters")
    tool = rpb.ChatTool(name=fn["name"], description=description or "")
    if params is None:
        return tool, _ANY_OBJECT
    param = f"{where}.function.parameters"
    tool.parameters_json = schema_text(params, param)
    checked(GrammarSpec(GrammarKind.JSON_SCHEMA, tool.parameters_json), param)
    return tool, params


def _required_schema(schemas: Mapping[str, Any], parallel: bool) -> str:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
        }
        for name, params in schemas.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema, ensure_ascii=False)


def tool_plan(body: Mapping[str, Any]) -> ToolPlan | None:
    """The chat's tools and tool choice (None without tools and without a choice that needs them)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw in (None, []):
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice other than none and auto needs tools")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise _bad("tools", f"tools must be a list of at most {MAX_TOOLS} functions")
    tools, schemas = [], {}
    for i, value in enumerate(raw):
        tool, params = _tool(i, value)
        if tool.name in schemas:
            raise _bad(f"tools[{i}].function.name", f"two tools are named {tool.name!r}")
        tools.append(tool)
        schemas[tool.name] = params
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if choice is None or choice in ("none", "auto"):
        return ToolPlan(tuple(tools), choice or "auto", schemas=schemas)
    if choice == "required":
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, _required_schema(schemas, parallel is not False))
        return ToolPlan(tuple(tools), "required", grammar=checked(spec, "tools"), schemas=schemas)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", 'tool_choice must be none, auto, required or {"type": "function", ...}')
    if name not in schemas:
        raise _bad("tool_choice", f"tool_choice names {name[:64]!r}, which is not among the tools")
    params = schemas[name]
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(params, ensure_ascii=False))
    return ToolPlan(tuple(tools), "named", named=name, grammar=spec, schemas=schemas)


def tool_parser(plan: ToolPlan) -> ToolCalls:
    """The parser of one answer under `plan` (`tool_stream`; a choice of "none" parses nothing)."""
    return ToolCalls(plan.choice, plan.schemas, plan.named)


def tool_message(plan: ToolPlan, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of an answer and its finish reason ("tool_calls" when it made calls). The
    calls and their arguments are what a stream of the same answer sends (`tool_stream`)."""
    if plan.choice == "none" or finish != "stop":
        return {"role": "assistant", "content": text}, finish
    parser = tool_parser(plan)
    content, calls = assemble([*parser.feed(text), *parser.end()])
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"


def tool_calls(i: int, value: Any) -> list[rpb.ToolCall]:
    """An assistant turn's `tool_calls` (OpenAI's shape, arguments as JSON text) for the template."""
    if value in (None, []):
        return []
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise InvalidArgument(
            f"{where} must be a list of at most {MAX_TOOLS} calls", reason="INVALID_CHAT", param=where
        )
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", ""), str)
            or not isinstance(call.get("id", ""), str)
            or len(call.get("id", "")) > 256
        ):
            raise InvalidArgument(
                f"{where}[{j}] must be {{id, type: function, function: {{name, arguments}}}}",
                reason="INVALID_CHAT",
                param=f"{where}[{j}]",
            )
        out.append(rpb.ToolCall(id=call.get("id", ""), name=fn["name"], arguments=fn.get("arguments", "")))
    return out
