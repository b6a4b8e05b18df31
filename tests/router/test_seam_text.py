"""A migrated request's text after the seam equals one uninterrupted engine's, at every seam.

The uninterrupted run and the resumed engine are the reference engine's own `Request` (its
detokenizer, stop matcher and finish rules); the router's `SeamText` renders the resumed engine's
tokens. Cases put multi-byte characters split into single-byte tokens and stop strings across every
possible seam.
"""

from __future__ import annotations

import pytest
from xavier.v1 import types_pb2
from xavier_services.router.flows import Step
from xavier_services.router.seam_text import SeamText

from xavier_core.engine.api import FinishReason, Sampling
from xavier_core.engine.request import Request, Role
from xavier_core.engine.tiny import make_tiny
from xavier_core.text.tokenizer import TextTokenizer

_FINISH = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.load(make_tiny(tmp_path_factory.mktemp("seam") / "qwen2", "qwen2"))


def _byte(tok: TextTokenizer, b: int) -> int:
    return next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([b]))


def _run(tok: TextTokenizer, prompt: list[int], tokens: list[int], sampling: Sampling, stop_id: int | None):
    """(token, text, finish) per token an engine request accepts, up to its finish."""
    eos = frozenset({stop_id}) if stop_id is not None else frozenset()
    req = Request("r", prompt, sampling, Role.GENERATE, lambda _: None, tok, eos, 4096)
    out = []
    for t in tokens:
        event = req.accept(t, 0.0)
        out.append((t, event.text, _FINISH[event.finish]))
        if event.finish:
            break
    return out


def _cases(tok: TextTokenizer) -> list[tuple[list[int], tuple[str, ...], int | None]]:
    a = [_byte(tok, b) for b in "あ".encode()]
    smile = [_byte(tok, b) for b in "🙂".encode()]
    words = tok.encode("caf\u00e9 na\u00efve done", add_special_tokens=False)
    body = words[:3] + a + smile + words[3:] + a
    end = next(i for i in range(3, tok.vocab_size) if i not in body)
    return [
        (body, (), None),  # length finish, split characters
        (body, ("あ\U0001f642",), None),  # a stop string made of split characters
        (body, ("ve d",), None),
        ([*body, end], (), end),  # the last token stops by itself (an EOS): no text
        (body, ("あ",), None),  # a stop string twice: before min_tokens 8 it does not stop
    ]


@pytest.mark.parametrize("include", [False, True], ids=["cut", "kept"])
@pytest.mark.parametrize("min_tokens", [0, 8])
@pytest.mark.parametrize("case", range(5))
def test_text_after_every_seam_equals_the_uninterrupted_text(
    tok: TextTokenizer, case: int, min_tokens: int, include: bool
) -> None:
    tokens, stops, stop_id = _cases(tok)[case]
    prompt = tok.encode("The prompt:", add_special_tokens=False)
    rules = {"stop": stops, "ignore_eos": False, "include_stop_str_in_output": include}
    sampling = Sampling(max_tokens=len(tokens), min_tokens=min_tokens, **rules)  # type: ignore[arg-type]
    whole = _run(tok, prompt, tokens, sampling, stop_id)
    want_text, want_finish = "".join(t for _, t, _ in whole), whole[-1][2]
    assert want_finish != types_pb2.FINISH_REASON_UNSPECIFIED and len(whole) > 4
    for k in range(1, len(whole)):
        sent = [t for t, _, _ in whole[:k]]
        before = "".join(t for _, t, _ in whole[:k])
        # The resumed engine: prompt + tokens sent, max_tokens and min_tokens less them; it misses a
        # seam-spanning stop.
        later = Sampling(
            max_tokens=len(tokens) - k,
            min_tokens=max(0, min_tokens - k),
            **rules,  # type: ignore[arg-type]
        )
        resumed = _run(tok, prompt + sent, tokens[k:], later, stop_id)
        seam = SeamText(tok, prompt, sent, stops, min_tokens=min_tokens, include=include)
        text, finish, kept = before, 0, k
        for t, engine_text, engine_finish in resumed:
            step = seam.render(Step([t], engine_text, finish=engine_finish))
            text, finish, kept = text + step.text, step.finish, kept + len(step.token_ids)
            if finish:
                break
        assert (text, finish, kept) == (want_text, want_finish, len(whole)), (case, k)
