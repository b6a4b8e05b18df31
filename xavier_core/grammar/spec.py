"""What a request's grammar is, and the check every front applies before it travels."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from xavier_core.sampling import SamplingError

INVALID_GRAMMAR = "INVALID_GRAMMAR"
MAX_SCHEMA_CHARS = 256 << 10
MAX_REGEX_CHARS = 16 << 10
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""OpenAI's `json_object`: any JSON object (xgrammar reads an object schema without properties so)."""
# xgrammar's messages start with a timestamp and its C++ source location: the client gets the rest.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(error\.empty\(\)\) is false:\s*)?")


class GrammarError(SamplingError):
    """A grammar that cannot be used (malformed, unsupported or too large); `field` names the
    SamplingParams field (json_schema or regex), `reason` is INVALID_GRAMMAR."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message, field, INVALID_GRAMMAR)


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # `text` is a JSON Schema document
    JSON_OBJECT = "json_object"  # any JSON object; `text` is empty
    REGEX = "regex"  # `text` is a regular expression the whole output matches


@dataclass(frozen=True)
class GrammarSpec:
    """One request's grammar, as it travels (`SamplingParams.grammar`): nothing but its source text."""

    kind: GrammarKind
    text: str = ""

    @property
    def field(self) -> str:
        """The SamplingParams field that carries it."""
        return self.kind.value

    def check(self) -> None:
        """Raises `GrammarError` unless xgrammar can build the grammar (no vocabulary needed: the
        router checks a request this way before any engine sees it)."""
        self.check_text()
        build(self)

    def check_text(self) -> None:
        """Raises `GrammarError` for a source text that is empty or past its size limit."""
        limit = MAX_REGEX_CHARS if self.kind is GrammarKind.REGEX else MAX_SCHEMA_CHARS
        if len(self.text) > limit:
            raise GrammarError(f"{self.field} is longer than {limit} characters", self.field)
        if self.kind is not GrammarKind.JSON_OBJECT and not self.text:
            raise GrammarError(f"{self.field} is empty", self.field)


def build(spec: GrammarSpec) -> object:
    """The xgrammar `Grammar` of a spec (its errors raised as `GrammarError`)."""
    import xgrammar as xgr

    try:
        if spec.kind is GrammarKind.REGEX:
            return xgr.Grammar.from_regex(spec.text)
        schema = JSON_OBJECT_SCHEMA if spec.kind is GrammarKind.JSON_OBJECT else spec.text
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"{spec.field} cannot be used: {describe(exc)}", spec.field) from None


def describe(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location, first line only, at most 300 characters."""
    text = _LOCATION.sub("", str(exc).strip()).splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
