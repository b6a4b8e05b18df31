"""A chat's tools and tool calls as the chat template sees them (Hugging Face's shapes).

`ChatTool` renders as `{"type": "function", "function": {name, description, parameters}}` and a turn's
`ToolCall` as `{"id", "type": "function", "function": {name, arguments}}`, its arguments parsed when
they are JSON (templates write them with `tojson`), as transformers' `apply_chat_template(tools=...)`
expects them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from xavier.v1 import router_service_pb2 as rpb

from xavier_core.runtime import InvalidArgument

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function name as OpenAI allows it."""


def chat_tool(tool: rpb.ChatTool) -> dict[str, Any]:
    """A tool for the template; INVALID_ARGUMENT for a bad name or parameters that are not a JSON object."""
    if not TOOL_NAME.fullmatch(tool.name):
        raise InvalidArgument(
            "a tool's name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
            reason="INVALID_ARGUMENT",
            field="chat.tools.name",
            param="tools",
        )
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        try:
            parameters = json.loads(tool.parameters_json)
        except ValueError:
            parameters = None
        if not isinstance(parameters, dict):
            raise InvalidArgument(
                f"the parameters of tool {tool.name!r} must be a JSON object",
                reason="INVALID_GRAMMAR",
                field="chat.tools.parameters_json",
                param="tools",
            )
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_message(m: rpb.ChatMessage) -> dict[str, Any]:
    """A turn for the template: role and content, and its tool calls or the call it answers."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out
