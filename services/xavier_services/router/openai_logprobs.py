"""OpenAI logprobs objects of one choice, from the router's token ids, logprobs and alternatives.

Completions (the legacy shape lm-eval reads): `tokens`, `token_logprobs`, `top_logprobs` (per position a
dict of token text to logprob: the `logprobs` most likely tokens plus the chosen one, as OpenAI and vLLM
send it; null for `logprobs: 0`) and `text_offset`, each token's character offset in the choice's text,
continued across the chunks of a stream. With `echo` the prompt's tokens come first and its first token
has a null logprob and null alternatives (nothing precedes it). Chat: `content[j] = {token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}, ...]}` with exactly `top_logprobs` alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from xavier.v1 import types_pb2


class TokenNames(Protocol):
    """How a token reads: its text and its own bytes (`PromptEncoder` offers both)."""

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def prompt_rows(
    ids: Sequence[int], prompt: types_pb2.PromptLogprobs
) -> tuple[list[float | None], list[types_pb2.TopLogprobs | None]]:
    """The values and alternatives of an echoed prompt's positions: none for its first token."""
    if len(prompt.logprobs) != len(ids) - 1:
        raise ValueError(f"{len(prompt.logprobs)} prompt logprobs for a prompt of {len(ids)} tokens")
    tops: list[types_pb2.TopLogprobs | None] = [None]
    tops += list(prompt.top_logprobs) if prompt.top_logprobs else [None] * len(prompt.logprobs)
    return [None, *prompt.logprobs], tops


class ChoiceLogprobs:
    """Renders one choice's logprobs, chunk after chunk (the text offsets carry on)."""

    def __init__(self, names: TokenNames, *, chat: bool, top: int) -> None:
        self.names = names
        self.chat = chat
        self.top = top
        self.offset = 0

    def render(
        self,
        ids: Sequence[int],
        values: Sequence[float | None],
        tops: Sequence[types_pb2.TopLogprobs | None] = (),
    ) -> dict[str, Any]:
        """The logprobs object of tokens `ids` (their logprobs `values`; `tops` one per token when the
        request asked for alternatives)."""
        alts: Sequence[types_pb2.TopLogprobs | None] = tops or [None] * len(ids)
        if self.chat:
            return {"content": [self._chat_entry(t, v, a) for t, v, a in zip(ids, values, alts, strict=True)]}
        tokens = [self.names.token_text(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        top_json = None
        if self.top:
            top_json = [self._dict(t, v, a) for t, v, a in zip(ids, values, alts, strict=True)]
        return {
            "tokens": tokens,
            "token_logprobs": list(values),
            "top_logprobs": top_json,
            "text_offset": offsets,
        }

    def _entry(self, token: int, value: float | None) -> dict[str, Any]:
        return {
            "token": self.names.token_text(token),
            "logprob": value,
            "bytes": list(self.names.token_bytes(token)),
        }

    def _chat_entry(
        self, token: int, value: float | None, alts: types_pb2.TopLogprobs | None
    ) -> dict[str, Any]:
        entry = self._entry(token, value)
        pairs = zip(alts.token_ids, alts.logprobs, strict=True) if alts is not None else ()
        entry["top_logprobs"] = [self._entry(t, v) for t, v in pairs]
        return entry

    def _dict(
        self, token: int, value: float | None, alts: types_pb2.TopLogprobs | None
    ) -> dict[str, float] | None:
        if value is None or alts is None:
            return None  # an echoed prompt's first token: nothing scores it
        out = {self.names.token_text(t): v for t, v in zip(alts.token_ids, alts.logprobs, strict=True)}
        out.setdefault(self.names.token_text(token), value)
        return out
