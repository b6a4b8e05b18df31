"""The OpenAI and vLLM logit controls of a request body, read into `SamplingParams`.

`presence_penalty`, `frequency_penalty` (OpenAI), `repetition_penalty`, `min_tokens`, `min_p`,
`include_stop_str_in_output`, `truncate_prompt_tokens` (vLLM) and `logit_bias` (OpenAI: an object of
token ids, as decimal strings, to biases). Their ranges are the shared sampling limits
(`xavier_core.sampling`), checked by `openai_shapes.parse` with the rest; whether the chosen engine
honours them is the router's check of its features (`request.require_features`). `best_of` is the
router's own: `best_of_count`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xavier.v1 import types_pb2

from xavier_core.runtime import InvalidArgument
from xavier_core.sampling import MAX_TOKENS
from xavier_services.router.openai_body import get_bool, get_int, get_number

_MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(frozen=True)
class Controls:
    """The controls one body asks for; the defaults are off."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int = 0

    def limits(self) -> dict[str, Any]:
        """The keyword arguments of `check_sampling` these controls fill."""
        return {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens,
            "min_p": self.min_p,
        }

    def apply(self, s: types_pb2.SamplingParams) -> None:
        """Writes the controls into `s` (checked first: a float field takes any value)."""
        s.presence_penalty = self.presence_penalty
        s.frequency_penalty = self.frequency_penalty
        s.repetition_penalty = self.repetition_penalty
        s.logit_bias.update(self.logit_bias)
        s.min_tokens = self.min_tokens
        s.min_p = self.min_p
        s.include_stop_str_in_output = self.include_stop_str_in_output
        s.truncate_prompt_tokens = self.truncate_prompt_tokens


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    bad = InvalidArgument(
        "logit_bias must be an object of token ids (decimal strings) to numbers",
        reason="INVALID_SAMPLING",
        param="logit_bias",
    )
    if not isinstance(value, dict):
        raise bad
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad
        if isinstance(bias, bool) or not isinstance(bias, int | float) or int(key) > _MAX_TOKEN_ID:
            raise bad
        out[int(key)] = float(bias) if abs(bias) < 1e300 else float("inf")
    return out


def controls(body: Mapping[str, Any]) -> Controls:
    """The controls of `body`; a value of the wrong type is INVALID_SAMPLING naming it."""
    return Controls(
        presence_penalty=get_number(body, "presence_penalty", 0.0),
        frequency_penalty=get_number(body, "frequency_penalty", 0.0),
        repetition_penalty=get_number(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=get_int(body, "min_tokens", 0, MAX_TOKENS, reason="INVALID_SAMPLING") or 0,
        min_p=get_number(body, "min_p", 0.0),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
        truncate_prompt_tokens=get_int(
            body, "truncate_prompt_tokens", 1, MAX_TOKENS, reason="INVALID_SAMPLING"
        )
        or 0,
    )


def best_of_count(body: Mapping[str, Any], n: int, stream: bool, limit: int) -> int:
    """OpenAI's `best_of` (completions): how many sequences each prompt samples, of which the `n` with
    the highest cumulative logprob are returned; at least `n` (the default), at most `limit`, and not
    with `stream` (OpenAI refuses that too: the best are known only once all have ended)."""
    best_of = get_int(body, "best_of", 1, limit, reason="INVALID_SAMPLING")
    if best_of is None:
        return n
    if best_of < n:
        raise InvalidArgument(
            f"best_of ({best_of}) must be at least n ({n})", reason="INVALID_SAMPLING", param="best_of"
        )
    if stream and best_of > 1:
        raise InvalidArgument("best_of cannot be streamed", reason="UNSUPPORTED_PARAMETER", param="best_of")
    return best_of
