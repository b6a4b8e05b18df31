"""Tool calls read from an answer as its text arrives: one parser for streamed and whole answers alike.

`ToolCalls.feed` takes the answer's text in pieces of any size and returns what can be sent now:
`Content` (text beside the calls), `CallStart` (a call's index, id and function name, once the name is
known) and `CallArgs` (the next raw fragment of that call's arguments, as the model writes them).
`ToolCalls.end` returns the rest. The events do not depend on how the text was cut, so a stream's
fragments concatenate to the arguments of the whole answer, which `openai_tools.tool_message` reads with
this same parser.

What is held back: text that may still begin a `<tool_call>` tag (auto), a call until its function name
is complete, whitespace before a tag (dropped when the block is a call, sent with it otherwise) and
at the end of the text (dropped when the answer made calls); the content's first whitespace is dropped
when calls came before it. A block that names no known tool, or is no JSON object, is content as
written; a block naming a known tool is a call whatever follows (its arguments as far as they came).
The forms are `openai_tools`': auto `<tool_call>{"name", "arguments"}</tool_call>` blocks, required a
JSON array of `{"name", "parameters"}`, named the arguments alone.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Content:
    """Text of the answer beside its calls."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call begins: its place among the answer's calls, its id and its function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """The next raw fragment of call `index`'s arguments."""

    index: int
    fragment: str


ToolEvent = Content | CallStart | CallArgs


def call_id() -> str:
    """A new call id, as OpenAI's look."""
    return f"call_{uuid.uuid4().hex[:24]}"


class _Scan:
    """One JSON object, a character at a time: its top-level `name` string, and the raw text of the value
    under the first of `args_keys` it has (`partial_args`: an object or array value as far as it came;
    a string or scalar value once it ended). Anything that is not an object ends it as `bad`."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.state = "start"  # start, key, colon, value, in_value, after, done, bad
        self.in_str = self.escape = False
        self.nest = 0  # brackets open in a nested value
        self.buf = ""  # the key or the value being read
        self.key = ""
        self.kind = ""  # the value's: nested, string or scalar
        self.name: str | None = None
        self.args: str | None = None
        self.args_nested = False

    @property
    def ended(self) -> bool:
        return self.state in ("done", "bad")

    @property
    def partial_args(self) -> str | None:
        """The arguments' raw text so far, for an object or array value (None otherwise)."""
        if (
            self.state == "in_value"
            and self.kind == "nested"
            and self.key in self.args_keys
            and self.args is None
        ):
            return self.buf
        return self.args if self.args_nested else None

    def _quoted(self, ch: str) -> bool:
        """Advances the string state over `ch`; True when `ch` belongs to a string (quotes included)."""
        if self.in_str:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_str = False
            return True
        if ch == '"':
            self.in_str = True
            return True
        return False

    def feed(self, ch: str) -> None:
        state = self.state
        if state == "in_value":
            self._value(ch)
        elif state == "start":
            self.state = "key" if ch == "{" else ("start" if ch.isspace() else "bad")
        elif state == "key":
            if self._quoted(ch):
                self.buf += ch
                if not self.in_str:
                    self.key, self.buf, self.state = _decoded(self.buf), "", "colon"
            elif ch == "}":
                self.state = "done"
            elif not (ch.isspace() or ch == ","):
                self.state = "bad"
        elif state == "colon":
            self.state = "value" if ch == ":" else ("colon" if ch.isspace() else "bad")
        elif state == "value" and not ch.isspace():
            self.kind = "string" if ch == '"' else ("nested" if ch in "{[" else "scalar")
            self.state, self.buf = "in_value", ""
            self._value(ch)
        elif state == "after":
            self.state = (
                "done" if ch == "}" else ("key" if ch == "," else ("after" if ch.isspace() else "bad"))
            )

    def _value(self, ch: str) -> None:
        if self.kind == "scalar":
            if ch.isspace() or ch in ",}":
                self._value_ended()
                self.feed(ch)
            else:
                self.buf += ch
            return
        self.buf += ch
        quoted = self._quoted(ch)
        if self.kind == "string":
            if not self.in_str:
                self._value_ended()
        elif not quoted:
            self.nest += (ch in "{[") - (ch in "}]")
            if self.nest == 0:
                self._value_ended()

    def _value_ended(self) -> None:
        raw, self.buf, self.state = self.buf, "", "after"
        if self.key == "name" and self.kind == "string":
            self.name = _decoded(raw)
        elif self.key in self.args_keys and self.args is None:
            self.args, self.args_nested = raw, self.kind == "nested"


def _decoded(raw: str) -> str:
    """A JSON string's value ("" for anything else)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


def _whole_args(raw: str) -> str:
    """The arguments text of a value that did not stream: a JSON string is the arguments' own text."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw


@dataclass
class _Call:
    index: int
    scan: _Scan
    id: str = field(default_factory=call_id)
    started: bool = False
    sent: int = 0  # characters of the arguments already sent


def merged(events: Iterable[ToolEvent]) -> list[ToolEvent]:
    """Adjacent text, and adjacent fragments of one call, as one event (one chunk each)."""
    out: list[ToolEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + event.text)
        elif isinstance(event, CallArgs) and isinstance(last, CallArgs) and last.index == event.index:
            out[-1] = CallArgs(event.index, last.fragment + event.fragment)
        else:
            out.append(event)
    return out


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCalls:
    """The parser of one answer under a tool plan's `choice` ("auto", "required" or "named")."""

    def __init__(self, choice: str, names: Iterable[str], named: str = "") -> None:
        self.choice, self.names, self.named = choice, frozenset(names), named
        self.calls = 0  # calls started
        self._call: _Call | None = None
        self._held = ""  # auto, outside a block: text not sent yet
        self._gap = ""  # auto: the whitespace before the open block's tag
        self._block: str | None = None  # auto: the open block's text after its tag
        self._fed = 0  # characters of the block read by its call's scanner
        self._after_call = False  # auto: calls came before any content (whose whitespace first is dropped)
        self._sent = False  # auto: some content was sent
        self._named_id = call_id()

    def feed(self, text: str) -> list[ToolEvent]:
        """The events `text` (the next piece of the answer) makes ready."""
        if self.choice == "named":
            out: list[ToolEvent] = []
            if not self.calls:
                self.calls = 1
                out.append(CallStart(0, self._named_id, self.named))
            return out + ([CallArgs(0, text)] if text else [])
        if self.choice == "required":
            return merged(event for ch in text for event in self._required(ch))
        return merged(self._auto(text))

    def end(self) -> list[ToolEvent]:
        """The events the end of the answer releases."""
        if self.choice == "named":
            return self.feed("")
        if self.choice == "required":
            return self._end_call()
        out = self._close_block() if self._block is not None else []
        held, self._held = self._held, ""
        return merged(out + self._content(held.rstrip() if self.calls else held))

    # --- calls -----------------------------------------------------------------------------

    def _progress(self, call: _Call) -> list[ToolEvent]:
        """What a call can send now: its start once it names a known tool, then its arguments."""
        out: list[ToolEvent] = []
        scan = call.scan
        if not call.started:
            if scan.name is None or scan.name not in self.names:
                return out
            call.started = True
            self.calls += 1
            out.append(CallStart(call.index, call.id, scan.name))
        args = scan.partial_args
        if args is not None and len(args) > call.sent:
            out.append(CallArgs(call.index, args[call.sent :]))
            call.sent = len(args)
        return out

    def _end_call(self) -> list[ToolEvent]:
        """The open call's last events: arguments that did not stream, `{}` when it had none."""
        call, self._call = self._call, None
        if call is None:
            return []
        out = self._progress(call)
        if call.started and not call.sent:
            args = call.scan.args
            out.append(CallArgs(call.index, "{}" if args is None else _whole_args(args)))
        return out

    def _required(self, ch: str) -> list[ToolEvent]:
        if self._call is None:
            if ch != "{":
                return []  # the array's brackets, commas and whitespace
            self._call = _Call(self.calls, _Scan(("parameters", "arguments")))
        call = self._call
        call.scan.feed(ch)
        out = self._progress(call)
        return out + self._end_call() if call.scan.ended else out

    # --- auto: <tool_call> blocks ----------------------------------------------------------

    def _content(self, text: str) -> list[ToolEvent]:
        if self._after_call:  # the answer's content starts after its first calls: no whitespace first
            text = text.lstrip()
            self._after_call = not text
        if text:
            self._sent = True
        return [Content(text)] if text else []

    def _auto(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        while text:
            if self._block is not None:
                text = self._block_text(text, out)
                continue
            held, text = self._held + text, ""
            at = held.find(_OPEN)
            if at >= 0:
                before, text = held[:at], held[at + len(_OPEN) :]
                cut = len(before.rstrip())
                out += self._content(before[:cut])
                self._held, self._gap, self._block, self._fed = "", before[cut:], "", 0
                self._call = _Call(self.calls, _Scan(("arguments", "parameters")))
                continue
            cut = len(held[: len(held) - _partial(held, _OPEN)].rstrip())
            out += self._content(held[:cut])
            self._held = held[cut:]
        return out

    def _block_text(self, text: str, out: list[ToolEvent]) -> str:
        """Reads an open block's text up to its close tag; returns what follows the tag ("" while open)."""
        block = (self._block or "") + text
        at = block.find(_CLOSE)
        body_end = at if at >= 0 else len(block) - _partial(block, _CLOSE)
        call = self._call
        if call is not None:
            for ch in block[self._fed : body_end]:
                call.scan.feed(ch)
                out += self._progress(call)
        self._fed = max(self._fed, body_end)
        if at < 0:
            self._block = block
            return ""
        self._block = block[: at + len(_CLOSE)]
        out += self._close_block()
        return block[at + len(_CLOSE) :]

    def _close_block(self) -> list[ToolEvent]:
        """Ends the open block: a call, or (naming no known tool) content as written."""
        call = self._call
        block, gap = _OPEN + (self._block or ""), self._gap
        self._block, self._gap = None, ""
        started = call is not None and call.started
        out = self._end_call()
        if started:
            self._after_call = not self._sent
            return out
        return out + self._content(gap + block)


def assemble(events: Iterable[ToolEvent]) -> tuple[str, list[dict[str, Any]]]:
    """An answer's content and its calls in OpenAI's shape (`{id, type, function: {name, arguments}}`)."""
    content, calls = "", dict[int, dict[str, Any]]()
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            calls[event.index] = {
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
        else:
            calls[event.index]["function"]["arguments"] += event.fragment
    return content, [calls[i] for i in sorted(calls)]


def delta_of(event: ToolEvent) -> dict[str, Any]:
    """A chunk's `delta` for one event: OpenAI's first `tool_calls` entry of a call carries its id,
    type and name with empty arguments, the next ones argument fragments alone."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallStart):
        fn = {"name": event.name, "arguments": ""}
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": fn}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}
