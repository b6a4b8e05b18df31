"""Random JSON schemas for structured-output tests, and a validator of exactly the keywords they use.

Every schema is bounded (strings by maxLength, arrays by maxItems, integers by a range, nesting by
depth), so a model that follows it must end; the model's weights are random, so only the grammar makes
its outputs valid.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_NAMES = ("a", "id", "name", "value", "tags", "ok", "x_1", "zz")


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    def integer(bounds: tuple[int, int]) -> dict[str, Any]:
        return {"type": "integer", "minimum": min(bounds), "maximum": max(bounds)}

    def string(lengths: tuple[int, int]) -> dict[str, Any]:
        return {"type": "string", "minLength": min(lengths), "maxLength": max(lengths)}

    words = st.lists(
        st.sampled_from(["red", "green", "blue", "yes", "no"]), min_size=1, max_size=3, unique=True
    )
    return st.one_of(
        st.tuples(st.integers(-1000, 1000), st.integers(-1000, 1000)).map(integer),
        st.tuples(st.integers(0, 6), st.integers(0, 6)).map(string),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        words.map(lambda w: {"enum": w}),
    )


def _extend(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def array(args: tuple[dict[str, Any], int, int]) -> dict[str, Any]:
        items, lo, hi = args
        return {"type": "array", "items": items, "minItems": min(lo, hi), "maxItems": max(lo, hi)}

    def obj(args: tuple[dict[str, dict[str, Any]], list[bool]]) -> dict[str, Any]:
        props, flags = args
        required = [k for k, flag in zip(props, flags, strict=False) if flag]
        return {"type": "object", "properties": props, "required": required}

    props = st.dictionaries(st.sampled_from(_NAMES), inner, min_size=1, max_size=3)
    return st.one_of(
        st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(array),
        st.tuples(props, st.lists(st.booleans(), min_size=3, max_size=3)).map(obj),
    )


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Object schemas whose values are leaves, arrays or objects, at most three levels deep."""
    inner = st.recursive(_leaf(), _extend, max_leaves=4)
    return st.dictionaries(st.sampled_from(_NAMES), inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)}
    )


def errors(value: Any, schema: dict[str, Any], at: str = "$") -> list[str]:
    """Where `value` breaks `schema` (empty: it validates); additional properties are refused, as a
    strict schema has them."""
    if "enum" in schema:
        return [] if value in schema["enum"] else [f"{at}: {value!r} not in the enum"]
    kind = schema["type"]
    if kind == "null":
        return [] if value is None else [f"{at}: not null"]
    if kind == "boolean":
        return [] if isinstance(value, bool) else [f"{at}: not a boolean"]
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return (
            []
            if ok and schema["minimum"] <= value <= schema["maximum"]
            else [f"{at}: {value!r} out of range"]
        )
    if kind == "string":
        ok = isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema.get(
            "maxLength", 1 << 30
        )
        return [] if ok else [f"{at}: {value!r} not a string of the allowed length"]
    if kind == "array":
        if not isinstance(value, list) or not schema.get("minItems", 0) <= len(value) <= schema.get(
            "maxItems", 1 << 30
        ):
            return [f"{at}: not an array of the allowed length"]
        return [e for i, v in enumerate(value) for e in errors(v, schema["items"], f"{at}[{i}]")]
    if not isinstance(value, dict):
        return [f"{at}: not an object"]
    out = [f"{at}: extra key {k!r}" for k in value if k not in schema["properties"]]
    out += [f"{at}: missing {k!r}" for k in schema.get("required", ()) if k not in value]
    for key, sub in schema["properties"].items():
        if key in value:
            out += errors(value[key], sub, f"{at}.{key}")
    return out
