"""A grammar as `SamplingParams.grammar` carries it (the oneof of json_schema, json_object and regex)."""

from __future__ import annotations

from xavier.v1 import types_pb2

from xavier_core.grammar.spec import GrammarKind, GrammarSpec


def grammar_from_pb(p: types_pb2.SamplingParams) -> GrammarSpec | None:
    """The request's grammar, None when unset (json_object false is unset too)."""
    kind = p.WhichOneof("grammar")
    if kind == "json_schema":
        return GrammarSpec(GrammarKind.JSON_SCHEMA, p.json_schema)
    if kind == "regex":
        return GrammarSpec(GrammarKind.REGEX, p.regex)
    if kind == "json_object" and p.json_object:
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    return None


def grammar_to_pb(spec: GrammarSpec, p: types_pb2.SamplingParams) -> None:
    """Sets `p`'s grammar to `spec`."""
    if spec.kind is GrammarKind.JSON_SCHEMA:
        p.json_schema = spec.text
    elif spec.kind is GrammarKind.REGEX:
        p.regex = spec.text
    else:
        p.json_object = True
