"""Streamed text equals HF transformers' decode of the whole output, incomplete UTF-8 included."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from xavier_core.engine.api import Sampling
from xavier_core.engine.request import Request, Role
from xavier_core.text.tokenizer import IncrementalDetokenizer, TextTokenizer


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tokenizers(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> tuple[TextTokenizer, object]:
    path = tiny_dirs[request.param]
    return TextTokenizer.load(path), PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


def _byte_token(tok: TextTokenizer, b: int) -> int:
    """The id of the single-byte token for byte `b` (the byte-level alphabet is in every tiny vocab)."""
    for i in range(tok.vocab_size):
        if tok.token_bytes(i) == bytes([b]):
            return i
    raise AssertionError(f"no token for byte {b:#x}")


def _streamed(tok: TextTokenizer, ids: list[int], context: list[int]) -> str:
    detok = IncrementalDetokenizer(tok, context)
    return "".join(detok.push(t) for t in ids) + detok.flush()


def _cases(tok: TextTokenizer) -> list[list[int]]:
    lead, cont = _byte_token(tok, 0xE3), _byte_token(tok, 0x81)
    text = tok.encode("café 🙂 naïve — “done”", add_special_tokens=False)
    rng = random.Random(7)
    singles = [_byte_token(tok, b) for b in (0xE3, 0x81, 0x82, 0xF0, 0x9F, 0xC3, 0xA9, 0x41)]
    cases = [
        [lead] * 20,  # the case: HF gives 20 x U+FFFD
        [*text, lead],  # a truncated last character
        [*text, lead, cont],  # two of three bytes
        [lead, *text],  # an invalid byte mid-stream, then valid text
    ]
    cases += [[rng.choice([*singles, *text]) for _ in range(rng.randint(1, 24))] for _ in range(40)]
    return cases


def test_streamed_text_matches_hf_decode(tokenizers: tuple[TextTokenizer, object]) -> None:
    tok, hf = tokenizers
    context = tok.encode("prefix ", add_special_tokens=False)
    for ids in _cases(tok):
        expected = hf.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        assert _streamed(tok, ids, context) == expected, ids
    assert _streamed(tok, [_byte_token(tok, 0xE3)] * 20, context) == "\ufffd" * 20


def test_engine_request_text_ends_with_the_held_back_bytes(tokenizers: tuple[TextTokenizer, object]) -> None:
    tok, hf = tokenizers
    for ids in _cases(tok)[:12]:
        req = Request(
            id="r",
            prompt=tok.encode("hi", add_special_tokens=False),
            sampling=Sampling(max_tokens=len(ids), ignore_eos=True),
            role=Role.GENERATE,
            deliver=lambda _: None,
            tokenizer=tok,
            eos_ids=frozenset(),
            max_context=4096,
        )
        events = [req.accept(t, 0.0) for t in ids]
        assert events[-1].finish is not None
        assert "".join(e.text for e in events) == hf.decode(ids), ids  # type: ignore[attr-defined]


def test_token_bytes_are_the_tokens_own_bytes(tokenizers: tuple[TextTokenizer, object]) -> None:
    tok, _ = tokenizers
    text = "café 🙂 naïve — “done” 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    lead = _byte_token(tok, 0xE3)
    assert tok.token_bytes(lead) == b"\xe3" and tok.decode([lead]) == "\ufffd"
