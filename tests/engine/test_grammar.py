"""Grammars on the reference engine: masked sampling per request in a shared batch, the P/D handoff
(the decode replays the first token into a fresh matcher), bad grammars, and requests without one
unchanged."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable

import pytest

from xavier_core.engine.api import FinishReason, InvalidRequestError, Sampling, TokenEvent
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.grammar import GrammarError, GrammarKind, GrammarSpec

from .conftest import collect, greedy_tokens, pd_events, prompt_of

Factory = Callable[..., ReferenceEngine]
_SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "s": {"type": "string", "maxLength": 6},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["n", "s", "flags"],
}
_REGEX = r"[a-z]{2,6}-[0-9]{1,3}"


def _text(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def _checks_schema(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"n", "s", "flags"}
    assert isinstance(value["n"], int) and -5 <= value["n"] <= 500
    assert isinstance(value["s"], str) and len(value["s"]) <= 6
    assert isinstance(value["flags"], list) and len(value["flags"]) <= 3
    assert all(isinstance(f, bool) for f in value["flags"])


async def test_batched_requests_each_follow_their_own_grammar(engine_factory: Factory) -> None:
    engine = engine_factory("qwen2")
    prompt = prompt_of(engine, 20)
    alone = await greedy_tokens(engine, prompt, 24, rid="alone")
    schema = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(_SCHEMA))
    regex = GrammarSpec(GrammarKind.REGEX, _REGEX)
    runs = [
        engine.generate("schema", prompt, Sampling(max_tokens=200, grammar=schema)),
        engine.generate("hot", prompt, Sampling(max_tokens=200, temperature=1.0, seed=3, grammar=schema)),
        engine.generate("regex", prompt, Sampling(max_tokens=200, grammar=regex)),
        # Any object: its keys are free strings, which this random model may never close; this prompt's
        # object ends.
        engine.generate(
            "object", [5, 6, 7, 8], Sampling(max_tokens=200, grammar=GrammarSpec(GrammarKind.JSON_OBJECT))
        ),
        engine.generate("plain", prompt, Sampling(max_tokens=24, ignore_eos=True)),
    ]
    results = await asyncio.gather(*(collect(r) for r in runs))
    for events in results[:4]:
        assert events[-1].finish is FinishReason.STOP
    _checks_schema(json.loads(_text(results[0])))
    _checks_schema(json.loads(_text(results[1])))
    assert re.fullmatch(_REGEX, _text(results[2]))
    assert isinstance(json.loads(_text(results[3])), dict)
    # The request without a grammar, batched with the others, samples what it samples alone.
    assert [e.token_id for e in results[4]] == alone
    # The model left alone writes no JSON: only the grammar makes these outputs valid.
    with pytest.raises(ValueError):
        json.loads(engine.tokenizer.decode(alone))


async def test_decode_continues_the_prefills_grammar(engine_factory: Factory) -> None:
    prefill, decode = engine_factory("qwen2"), engine_factory("qwen2")
    prompt = prompt_of(prefill, 40)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(_SCHEMA))
    sampling = Sampling(max_tokens=200, grammar=spec)
    whole = await collect(prefill.generate("whole", prompt, sampling))
    events = await pd_events(prefill, decode, "req", prompt, sampling)
    assert [e.token_id for e in events] == [e.token_id for e in whole]  # greedy P/D equals colocated
    _checks_schema(json.loads(_text(events)))
    assert decode.stats().pages_pinned == 0


async def test_a_first_token_outside_the_grammar_is_refused(engine_factory: Factory) -> None:
    engine = engine_factory("qwen2")
    prompt = prompt_of(engine, 20)
    letter = engine.tokenizer.encode("x", add_special_tokens=False)[0]  # no JSON object starts with x
    sampling = Sampling(max_tokens=20, grammar=GrammarSpec(GrammarKind.JSON_OBJECT))
    engine.reserve_pages("d", len(prompt))
    with pytest.raises(InvalidRequestError, match="does not follow its grammar"):
        await collect(engine.decode_from_pages("d", prompt, letter, -1.0, sampling))
    engine.release_pages("d")
    s = engine.stats()
    assert s.pages_free == s.pages_total and s.pages_pinned == 0


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "nope"}'), "json_schema"),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json"), "json_schema"),
        (GrammarSpec(GrammarKind.REGEX, "(("), "regex"),
        (GrammarSpec(GrammarKind.REGEX, ""), "regex"),
    ],
)
async def test_bad_grammars_are_refused_naming_the_field(
    engine_factory: Factory, spec: GrammarSpec, field: str
) -> None:
    engine = engine_factory("qwen2")
    with pytest.raises(GrammarError) as info:
        spec.check()
    assert info.value.field == field and info.value.reason == "INVALID_GRAMMAR"
    assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)  # no library internals
    with pytest.raises(GrammarError):
        await collect(engine.generate("bad", [5, 6, 7], Sampling(max_tokens=4, grammar=spec)))
    assert engine.stats().running == 0


def test_a_step_without_grammars_is_left_alone(engine_factory: Factory) -> None:
    """No request of the step has a grammar: the logits are the very tensor the model gave (no copy,
    no mask); with one, only its row changes."""
    import torch

    from xavier_core.grammar.masks import constrain

    engine = engine_factory("qwen2")
    logits = torch.randn(3, engine.vocab_size, generator=torch.Generator().manual_seed(0))
    assert constrain(logits, [None, None, None]) is logits
    grammar = engine._grammars.matcher(GrammarSpec(GrammarKind.REGEX, "[0-9]+"))
    masked = constrain(logits, [None, grammar, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = [t for t in range(engine.vocab_size) if masked[1, t] > float("-inf")]
    assert allowed and all(engine.tokenizer.decode([t]).isdigit() for t in allowed)
