"""Grammars on the engine: one compiler per engine, one matcher per request, masks per step.

The compiler knows the engine's vocabulary as bytes (special tokens other than the stop tokens are never
allowed: their entries are empty), padded to the model's vocabulary size, so a padded id is never
sampled. Only requests that carry a grammar cost anything: `constrain` fills a bitmask row per such
request and leaves the step's other rows alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from xavier_core.grammar.spec import JSON_OBJECT_SCHEMA, GrammarError, GrammarKind, GrammarSpec, describe
from xavier_core.text.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


class TokenGrammar:
    """One request's matcher: the state of its grammar after the tokens accepted so far. `only` (a
    bitmask row) further limits every step to the tokens it allows."""

    def __init__(self, matcher: Any, only: torch.Tensor | None = None) -> None:
        self._matcher = matcher  # an xgrammar GrammarMatcher (xgrammar ships no type stubs)
        self._only = only

    def accept(self, token: int) -> bool:
        """Advances by one token; False (nothing changed) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and its stop token accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of `bitmask`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._only is not None:
            bitmask[row] &= self._only


class GrammarCompiler:
    """Compiles specs against one engine's vocabulary; safe to call from several threads."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: Collection[int]) -> None:
        import xgrammar as xgr

        specials = tokenizer.special_texts
        encoded = []
        for token_id in range(min(tokenizer.vocab_size, vocab_size)):
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            encoded.append(b"" if text in specials else tokenizer.token_bytes(token_id))
        info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        # Compact JSON holds no raw control character, yet xgrammar 0.2.9 lets a string with maxLength
        # take any byte but quote, backslash, CR and LF: JSON grammars also exclude every token with a
        # byte below 0x20.
        self._json_only = _bitmask_row([not any(b < 0x20 for b in e) for e in encoded], vocab_size)

    def matcher(self, spec: GrammarSpec) -> TokenGrammar:
        """A fresh matcher of `spec` (raises `GrammarError` for one that does not compile)."""
        import xgrammar as xgr

        spec.check_text()
        try:
            if spec.kind is GrammarKind.REGEX:
                compiled = self._compiler.compile_regex(spec.text)
            else:
                schema = JSON_OBJECT_SCHEMA if spec.kind is GrammarKind.JSON_OBJECT else spec.text
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"{spec.field} cannot be used: {describe(exc)}", spec.field) from None
        only = None if spec.kind is GrammarKind.REGEX else self._json_only
        return TokenGrammar(xgr.GrammarMatcher(compiled), only)


def _bitmask_row(allowed: Sequence[bool], vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask row (int32 words, bit j of word w: token 32 w + j) allowing `allowed`'s true
    entries; ids past `allowed` (the model's padding) are not allowed."""
    words = -(-vocab_size // 32)
    bits = torch.zeros(words * 32, dtype=torch.long)
    bits[: len(allowed)] = torch.tensor(list(allowed), dtype=torch.long)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


class LazyCompiler:
    """Builds the engine's `GrammarCompiler` on the first request that needs one (reading the whole
    vocabulary takes a while on a large one, and most engines never see a grammar)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: Collection[int]) -> None:
        self._args = (tokenizer, vocab_size, frozenset(stop_ids))
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None

    def matcher(self, spec: GrammarSpec) -> TokenGrammar:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
        return self._compiler.matcher(spec)


def constrain(logits: torch.Tensor, grammars: Sequence[TokenGrammar | None]) -> torch.Tensor:
    """`logits` (one row per entry of `grammars`) with every token a row's grammar forbids at -inf: a
    float32 copy when any row has a grammar, else `logits` itself, untouched."""
    rows = [row for row, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[-1])
    for row in rows:
        grammar = grammars[row]
        if grammar is not None:
            grammar.fill(bitmask, row)
    out = logits.to(torch.float32, copy=True)
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    return out
