"""`Sampling.resumed_output_tokens` on the reference engine: the prompt's tail is output an earlier
attempt produced. Presence and frequency penalties count it and the grammar's matcher accepts it, so a
request resumed after k tokens of a greedy run continues that run exactly, colocated and over P/D (the
prefill samples the first new token under the same rules); output outside the grammar is refused."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest

from xavier_core.engine.api import (
    EngineFeature,
    FinishReason,
    InvalidRequestError,
    ResumedOutputError,
    Sampling,
)
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.grammar import GrammarKind, GrammarSpec
from xavier_core.runtime.domain_errors import engine_status

from .conftest import collect, pd_events, prompt_of
from .test_grammar import _SCHEMA, _checks_schema

Factory = Callable[..., ReferenceEngine]
SEAMS = (1, 4, 11)


async def _tokens(engine: ReferenceEngine, rid: str, prompt: list[int], s: Sampling) -> list[int]:
    return [e.token_id for e in await collect(engine.generate(rid, prompt, s))]


def _resumed(s: Sampling, k: int) -> Sampling:
    return dataclasses.replace(s, max_tokens=s.max_tokens - k, resumed_output_tokens=k)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(max_tokens=24, ignore_eos=True, frequency_penalty=1.5),
        Sampling(max_tokens=24, ignore_eos=True, presence_penalty=2.0),
    ],
    ids=["frequency", "presence"],
)
async def test_penalties_count_the_resumed_output(sampling: Sampling, engine_factory: Factory) -> None:
    engine, decode = engine_factory("llama"), engine_factory("llama")
    assert EngineFeature.RESUMED_OUTPUT in engine.features
    prompt = prompt_of(engine, 20)
    whole = await _tokens(engine, "whole", prompt, sampling)
    differs = 0
    for k in SEAMS:
        later = _resumed(sampling, k)
        assert await _tokens(engine, f"g{k}", prompt + whole[:k], later) == whole[k:], k
        over_pd = await pd_events(engine, decode, f"pd{k}", prompt + whole[:k], later)
        assert [e.token_id for e in over_pd] == whole[k:], k
        # Without the field the tokens sent are plain prompt: the penalties forget them.
        blind = dataclasses.replace(later, resumed_output_tokens=0)
        differs += await _tokens(engine, f"b{k}", prompt + whole[:k], blind) != whole[k:]
    assert differs, "the penalties never depended on the tokens sent: the test proves nothing"
    for e in (engine, decode):
        s = e.stats()
        assert s.running == 0 and s.pages_pinned == 0


async def test_a_grammar_continues_over_the_resumed_output(engine_factory: Factory) -> None:
    engine, decode = engine_factory("qwen2"), engine_factory("qwen2")
    prompt = prompt_of(engine, 30)
    sampling = Sampling(max_tokens=200, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(_SCHEMA)))
    whole = await collect(engine.generate("whole", prompt, sampling))
    ids = [e.token_id for e in whole]
    assert whole[-1].finish is FinishReason.STOP and len(ids) > max(SEAMS) + 2
    for k in (*SEAMS, len(ids) - 2):
        later = _resumed(sampling, k)
        for events in (
            await collect(engine.generate(f"g{k}", prompt + ids[:k], later)),
            await pd_events(engine, decode, f"pd{k}", prompt + ids[:k], later),
        ):
            assert [e.token_id for e in events] == ids[k:], k
            assert events[-1].finish is FinishReason.STOP
            _checks_schema(json.loads(engine.tokenizer.decode(ids[:k] + [e.token_id for e in events])))


async def test_resumed_output_outside_the_grammar_is_refused(engine_factory: Factory) -> None:
    engine = engine_factory("qwen2")
    prompt = prompt_of(engine, 20)
    sampling = Sampling(max_tokens=40, grammar=GrammarSpec(GrammarKind.JSON_OBJECT))
    x = engine.tokenizer.encode("x", add_special_tokens=False)[0]  # no JSON object starts with x
    brace = engine.tokenizer.encode("{", add_special_tokens=False)
    cases = [([*prompt, x], 1, "does not follow"), ([*prompt, *brace, x], len(brace) + 1, "does not follow")]
    done = await collect(engine.generate("done", [5, 6, 7, 8], sampling))  # an object that ends (EOS)
    assert done[-1].finish is FinishReason.STOP
    ended = [e.token_id for e in done]
    cases.append(([5, 6, 7, 8, *ended], len(ended), "already completes"))
    for i, (ids, k, why) in enumerate(cases):
        later = dataclasses.replace(sampling, resumed_output_tokens=k)
        with pytest.raises(ResumedOutputError, match=why) as info:
            await collect(engine.generate(f"bad{i}", ids, later))
        assert engine_status(info.value).reason == "RESUMED_OUTPUT_OUTSIDE_GRAMMAR"
        with pytest.raises(ResumedOutputError):
            await engine.prefill(f"badp{i}", ids, later)
        engine.reserve_pages(f"badd{i}", len(ids))
        with pytest.raises(ResumedOutputError):
            await collect(engine.decode_from_pages(f"badd{i}", ids, brace[0], -1.0, later))
        engine.release_pages(f"badd{i}")
    s = engine.stats()
    assert s.running == 0 and s.pages_pinned == 0 and s.pages_free == s.pages_total


async def test_resumed_output_must_leave_a_prompt(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    with pytest.raises(InvalidRequestError, match="resumed_output_tokens"):
        await collect(engine.generate("r", [5, 6, 7], Sampling(max_tokens=4, resumed_output_tokens=3)))
    # Without a grammar or the output penalties the field changes nothing.
    plain = Sampling(max_tokens=8, ignore_eos=True, repetition_penalty=1.5)
    assert await _tokens(engine, "a", [5, 6, 7], plain) == await _tokens(
        engine, "b", [5, 6, 7], dataclasses.replace(plain, resumed_output_tokens=2)
    )
