"""Penalties, logit_bias, min_tokens, min_p, stop strings kept and stop token ids on the reference
engine: each changes what a request samples as its definition says (the penalties against a hand
computation over transformers' logits), over P/D as colocated, and a request without them is unchanged."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from xavier_core.engine.api import FinishReason, InvalidRequestError, Sampling, TokenEvent
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.grammar import GrammarKind, GrammarSpec
from xavier_core.sampling import SamplingError

from .conftest import collect, pd_events, prompt_of

transformers = pytest.importorskip("transformers")
Factory = Callable[..., ReferenceEngine]


async def _run(engine: ReferenceEngine, prompt: list[int], s: Sampling, rid: str = "r") -> list[TokenEvent]:
    return await collect(engine.generate(rid, prompt, s))


async def _pd(prefill: ReferenceEngine, decode: ReferenceEngine, prompt: list[int], s: Sampling) -> list[int]:
    """The tokens of a prefill on one engine continued by a decode on the other."""
    return [e.token_id for e in await pd_events(prefill, decode, "pd", prompt, s)]


def _by_hand(path: Path, prompt: list[int], steps: int, s: Sampling) -> list[int]:
    """Greedy decoding over transformers' logits with the controls applied as vLLM defines them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].tolist()
            for token, bias in s.logit_bias:
                logits[token] += bias
            for token in set(prompt + out):
                if s.repetition_penalty != 1.0:
                    x = logits[token]
                    logits[token] = x / s.repetition_penalty if x > 0 else x * s.repetition_penalty
            for token in set(out):
                logits[token] -= s.frequency_penalty * out.count(token) + s.presence_penalty
            out.append(max(range(len(logits)), key=logits.__getitem__))
    return out


_CONTROLS = [
    Sampling(max_tokens=24, ignore_eos=True, repetition_penalty=1.8),
    Sampling(max_tokens=24, ignore_eos=True, repetition_penalty=0.7),
    Sampling(max_tokens=24, ignore_eos=True, frequency_penalty=1.5),
    Sampling(max_tokens=24, ignore_eos=True, presence_penalty=2.0),
    Sampling(max_tokens=24, ignore_eos=True, logit_bias=((7, 3.0), (40, -100.0)), frequency_penalty=0.5),
]


@pytest.mark.parametrize("sampling", _CONTROLS, ids=["rep1.8", "rep0.7", "freq", "presence", "bias+freq"])
async def test_penalties_follow_a_hand_computation(
    sampling: Sampling, engine_factory: Factory, tiny_dirs: dict[str, Path]
) -> None:
    engine = engine_factory("llama")
    prompt = prompt_of(engine, 20)
    plain = [e.token_id for e in await _run(engine, prompt, Sampling(max_tokens=24, ignore_eos=True), "p")]
    got = [e.token_id for e in await _run(engine, prompt, sampling)]
    assert got == _by_hand(tiny_dirs["llama"], prompt, 24, sampling)
    assert got != plain  # the control changed the greedy run
    # Over P/D the decode continues the prefill's state (its first token counted once, by both sides).
    assert await _pd(engine_factory("llama"), engine_factory("llama"), prompt, sampling) == got
    # A request without the controls is unchanged by running beside one that has them.
    both = [
        _run(engine, prompt, Sampling(max_tokens=24, ignore_eos=True), "a"),
        _run(engine, prompt, sampling, "b"),
    ]
    plain_again, controlled = await asyncio.gather(*both)
    assert [e.token_id for e in plain_again] == plain and [e.token_id for e in controlled] == got


async def test_the_penalties_count_what_vllm_counts(engine_factory: Factory) -> None:
    """Presence and frequency count the output only, repetition the prompt too: a prompt token the
    output never repeats is pushed down by repetition_penalty and untouched by the other two."""
    engine = engine_factory("llama")
    prompt = prompt_of(engine, 20)
    plain = [e.token_id for e in await _run(engine, prompt, Sampling(max_tokens=1), "p")]
    # The first token sees an empty output: presence and frequency cannot change it.
    for s in (Sampling(max_tokens=1, presence_penalty=2.0), Sampling(max_tokens=1, frequency_penalty=2.0)):
        assert [e.token_id for e in await _run(engine, prompt, s)] == plain
    # Two tokens far above the rest, the prompt's ahead: repetition_penalty divides only its logit.
    inside, outside = prompt[3], next(t for t in range(engine.vocab_size) if t not in prompt)
    bias = ((inside, 60.0), (outside, 50.0))
    for s in (
        Sampling(max_tokens=1, logit_bias=bias),
        Sampling(max_tokens=1, logit_bias=bias, presence_penalty=2.0, frequency_penalty=2.0),
    ):
        assert [e.token_id for e in await _run(engine, prompt, s)] == [inside]
    heavy = Sampling(max_tokens=1, logit_bias=bias, repetition_penalty=10.0)
    assert [e.token_id for e in await _run(engine, prompt, heavy)] == [outside]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_huge_logit_bias_forces_a_token(temperature: float, engine_factory: Factory) -> None:
    engine = engine_factory("qwen2")
    prompt = prompt_of(engine, 12)
    s = Sampling(max_tokens=10, temperature=temperature, seed=3, ignore_eos=True, logit_bias=((123, 100.0),))
    events = await _run(engine, prompt, s)
    assert [e.token_id for e in events] == [123] * 10
    # The logprobs stay the model's own, not the biased distribution's.
    assert all(e.logprob < -0.01 for e in events)


async def test_min_p_one_samples_the_greedy_tokens(engine_factory: Factory) -> None:
    engine = engine_factory("qwen3")
    prompt = prompt_of(engine, 12)
    greedy = [e.token_id for e in await _run(engine, prompt, Sampling(max_tokens=16, ignore_eos=True), "g")]
    hot = Sampling(max_tokens=16, temperature=1.5, seed=11, ignore_eos=True)
    sampled = [e.token_id for e in await _run(engine, prompt, hot, "h")]
    assert sampled != greedy
    cut = Sampling(max_tokens=16, temperature=1.5, seed=11, ignore_eos=True, min_p=1.0)
    assert [e.token_id for e in await _run(engine, prompt, cut, "c")] == greedy


async def _first_token(path: Path, prompt_len: int) -> tuple[list[int], int, frozenset[int]]:
    engine = ReferenceEngine.load(path, num_pages=64)
    try:
        prompt = prompt_of(engine, prompt_len)
        events = await _run(engine, prompt, Sampling(max_tokens=1))
        return prompt, events[0].token_id, engine.eos_token_ids
    finally:
        await engine.close()


@pytest.fixture
def eos_likely(tiny_dirs: dict[str, Path], tmp_path: Path) -> Path:
    """The llama checkpoint with the EOS row of its LM head made twice the row of the token greedy
    decoding picks first for `prompt_of(engine, 12)`: EOS becomes that token's stronger twin."""
    path = tmp_path / "eos"
    shutil.copytree(tiny_dirs["llama"], path)
    _, first, eos_ids = asyncio.run(_first_token(path, 12))
    weights = load_file(path / "model.safetensors")
    head = weights["lm_head.weight"]
    head[min(eos_ids)] = 2.0 * head[first]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


async def test_min_tokens_forbids_every_stop_before_n(eos_likely: Path) -> None:
    engines = [ReferenceEngine.load(eos_likely, num_pages=64) for _ in range(3)]
    engine = engines[0]
    try:
        prompt = prompt_of(engine, 12)
        plain = await _run(engine, prompt, Sampling(max_tokens=40), "p")
        assert len(plain) == 1 and plain[-1].token_id in engine.eos_token_ids  # EOS comes at once
        for temperature in (0.0, 1.0):
            s = Sampling(max_tokens=40, min_tokens=12, temperature=temperature, seed=5)
            events = await _run(engine, prompt, s, f"m{temperature}")
            ids = [e.token_id for e in events]
            assert len(ids) >= 12 and not set(ids[:12]) & engine.eos_token_ids, ids
            if events[-1].finish is FinishReason.STOP:
                assert ids[-1] in engine.eos_token_ids  # EOS ends it once allowed
        # Stop token ids and stop strings count only from min_tokens on, over P/D as colocated.
        s = Sampling(max_tokens=40, min_tokens=12, stop_token_ids=tuple(plain_ids(plain)))
        colocated = [e.token_id for e in await _run(engine, prompt, s, "c")]
        assert len(colocated) >= 12
        assert await _pd(engines[1], engines[2], prompt, s) == colocated
    finally:
        for e in engines:
            await e.close()


def plain_ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events]


async def test_stop_token_ids_stop_and_stop_strings_can_be_kept(engine_factory: Factory) -> None:
    engine = engine_factory("qwen2")
    prompt = prompt_of(engine, 12)
    whole = await _run(engine, prompt, Sampling(max_tokens=24, ignore_eos=True), "w")
    ids = plain_ids(whole)
    stopped = await _run(engine, prompt, Sampling(max_tokens=24, stop_token_ids=(ids[4],)), "s")
    first = ids.index(ids[4])
    assert plain_ids(stopped) == ids[: first + 1] and stopped[-1].finish is FinishReason.STOP
    text = "".join(e.text for e in whole)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    at = text.index(stop)
    for include, expected in ((False, text[:at]), (True, text[: at + len(stop)])):
        s = Sampling(max_tokens=24, ignore_eos=True, stop=(stop,), include_stop_str_in_output=include)
        events = await _run(engine, prompt, s, f"i{include}")
        assert "".join(e.text for e in events) == expected and events[-1].finish is FinishReason.STOP


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (Sampling(presence_penalty=2.5), "presence_penalty"),
        (Sampling(frequency_penalty=-3.0), "frequency_penalty"),
        (Sampling(repetition_penalty=0.0), "repetition_penalty"),
        (Sampling(logit_bias=((1, 101.0),)), "logit_bias"),
        (Sampling(max_tokens=4, min_tokens=5), "min_tokens"),
        (Sampling(min_p=1.5), "min_p"),
    ],
)
async def test_out_of_range_controls_are_refused(
    sampling: Sampling, field: str, engine_factory: Factory
) -> None:
    engine = engine_factory("llama")
    with pytest.raises(SamplingError) as info:
        await _run(engine, [1, 2, 3], sampling)
    assert info.value.field == field
    with pytest.raises(InvalidRequestError):
        await _run(engine, [1, 2, 3], Sampling(logit_bias=((engine.vocab_size, 1.0),)))
    with pytest.raises(InvalidRequestError):  # a grammar may allow only its end: nothing to sample
        await _run(engine, [1, 2, 3], Sampling(min_tokens=2, grammar=GrammarSpec(GrammarKind.JSON_OBJECT)))
