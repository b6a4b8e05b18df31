"""Structured output on the OpenAI front: `response_format` and vLLM's `guided_json` / `guided_regex`.

Each becomes one `GrammarSpec` in `SamplingParams.grammar`, checked here (a 400 naming the parameter)
before any engine sees it. The other vLLM spellings (`guided_choice`, `guided_grammar`,
`structured_outputs`) are refused by the caller; one request carries at most one grammar.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from xavier_core.grammar import GrammarError, GrammarKind, GrammarSpec
from xavier_core.runtime import InvalidArgument
from xavier_core.runtime.domain_errors import sampling_status


def _bad(param: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, reason="INVALID_GRAMMAR", param=param)


def checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec` once xgrammar accepts it; else INVALID_GRAMMAR naming `param`."""
    try:
        spec.check()
    except GrammarError as err:
        status = sampling_status(err)
        status.metadata["param"] = param
        raise status from None
    return spec


def schema_text(value: Any, param: str) -> str:
    """A JSON Schema given as an object (or a boolean, JSON Schema's true/false) as JSON text."""
    if not isinstance(value, dict | bool):
        raise _bad(param, f"{param} must be a JSON Schema object")
    return json.dumps(value, ensure_ascii=False)


def _response_format(fmt: Any) -> GrammarSpec | None:
    if not isinstance(fmt, dict):
        raise _bad("response_format", "response_format must be an object with a type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    if kind != "json_schema":
        raise _bad("response_format", "response_format.type must be text, json_object or json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise _bad("response_format", "response_format.json_schema must be an object with a schema")
    if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), bool | None):
        raise _bad("response_format", "response_format.json_schema name must be a string, strict a boolean")
    text = schema_text(spec["schema"], "response_format")
    return checked(GrammarSpec(GrammarKind.JSON_SCHEMA, text), "response_format")


def grammar_of(body: Mapping[str, Any]) -> tuple[GrammarSpec, str] | None:
    """The request's grammar and the parameter that set it, or None; a second one is refused."""
    found: list[tuple[GrammarSpec, str]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append((checked(spec, "response_format"), "response_format"))
    guided = body.get("guided_json")
    if guided is not None:
        text = guided if isinstance(guided, str) else schema_text(guided, "guided_json")
        found.append((checked(GrammarSpec(GrammarKind.JSON_SCHEMA, text), "guided_json"), "guided_json"))
    regex = body.get("guided_regex")
    if regex is not None:
        if not isinstance(regex, str):
            raise _bad("guided_regex", "guided_regex must be a string")
        found.append((checked(GrammarSpec(GrammarKind.REGEX, regex), "guided_regex"), "guided_regex"))
    if len(found) > 1:
        first, second = found[0][1], found[1][1]
        raise InvalidArgument(
            f"{second} cannot be combined with {first}: a request follows one grammar",
            reason="UNSUPPORTED_PARAMETER",
            param=second,
        )
    return found[0] if found else None
