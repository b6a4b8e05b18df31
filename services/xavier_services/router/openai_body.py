"""Decoding an untrusted OpenAI request body into plain JSON values, and typed reads of its fields.

Every problem is an INVALID_ARGUMENT whose `param` metadata names the field (OpenAI's error shape), so the
HTTP front answers 400 and never lets a malformed value reach protobuf (which raises on a lone surrogate or
an out-of-range integer) or the tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from xavier_core.runtime import InvalidArgument

MAX_DEPTH = 32
"""Nesting any OpenAI request needs is under 8 (chat content parts); deeper bodies are refused."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: UTF-8, valid JSON, at most `MAX_DEPTH` deep, no lone surrogates."""
    if not raw.strip():
        raise InvalidArgument("the request body is empty; send a JSON object", reason="INVALID_JSON")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"the request body is not UTF-8 (invalid byte at offset {exc.start})", reason="INVALID_JSON"
        ) from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise InvalidArgument(
            f"the request body nests deeper than {MAX_DEPTH} levels", reason="INVALID_JSON"
        ) from None
    except ValueError as exc:  # JSONDecodeError, and int() past its digit limit
        raise InvalidArgument(f"the request body is not valid JSON: {exc}", reason="INVALID_JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", reason="INVALID_JSON")
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    # Iterative, so a body just under the decoder's recursion limit cannot exhaust the stack here either.
    stack: list[tuple[str, Any, int]] = [("", body, 1)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidArgument(
                f"the request body nests deeper than {MAX_DEPTH} levels", reason="INVALID_JSON", param=path
            )
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise InvalidArgument(
                    f"{path or 'a key'} holds a lone UTF-16 surrogate, which is not text",
                    reason="INVALID_ARGUMENT",
                    param=path,
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):
                    raise InvalidArgument(
                        f"a key under {path or 'the body'} holds a lone UTF-16 surrogate",
                        reason="INVALID_ARGUMENT",
                        param=path,
                    )
                stack.append((child, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))


def _type_error(key: str, what: str) -> InvalidArgument:
    return InvalidArgument(f"{key} must be {what}", reason="INVALID_ARGUMENT", param=key)


def get_bool(body: Mapping[str, Any], key: str, default: bool = False, *, within: str = "") -> bool:
    """A JSON boolean (or null: `default`); the string "false" is not a boolean. `within` names the
    object `body` is (`stream_options`), so an error names the parameter as the client wrote it."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(f"{within}.{key}" if within else key, "a boolean")
    return value


def get_int(
    body: Mapping[str, Any], key: str, lo: int, hi: int, reason: str = "INVALID_ARGUMENT"
) -> int | None:
    """A JSON integer in [lo, hi], or None when absent/null; booleans and floats are refused."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{key} must be an integer", reason=reason, param=key)
    if not lo <= value <= hi:
        raise InvalidArgument(f"{key} must be in [{lo}, {hi}], got {value}", reason=reason, param=key)
    return value


def get_number(body: Mapping[str, Any], key: str, default: float) -> float:
    """A JSON number (or null: `default`); its range is the sampling validator's business."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{key} must be a number", reason="INVALID_SAMPLING", param=key)
    try:
        return float(value)
    except OverflowError:  # an integer too large for a float is out of every range
        return float("inf")


def get_str(body: Mapping[str, Any], key: str) -> str:
    """A JSON string, or "" when absent/null."""
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _type_error(key, "a string")
    return value


def get_object(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A JSON object, or {} when absent/null."""
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _type_error(key, "an object")
    return value
