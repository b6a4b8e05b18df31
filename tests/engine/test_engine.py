"""Scheduling behaviour of the reference engine: batching, prefix cache, aborts, preemption, stops."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
import torch

from xavier_core.engine.api import (
    AbortEvent,
    FinishReason,
    InvalidRequestError,
    OutOfPagesError,
    Sampling,
    TokenEvent,
)
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.timing import PHASES
from xavier_core.runtime.metrics import get_registry
from xavier_core.sampling import MAX_TOKENS, SamplingError, advance_seed, step_seed

from .conftest import ARCHS, collect, greedy_tokens, prompt_of

Factory = Callable[..., ReferenceEngine]


async def _wait_idle(engine: ReferenceEngine) -> None:
    for _ in range(500):
        s = engine.stats()
        if s.running == 0 and s.waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {engine.stats()}")


def _all_pages_free(engine: ReferenceEngine) -> None:
    s = engine.stats()
    assert s.pages_free == s.pages_total and s.pages_pinned == 0
    alloc = engine._allocator
    assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))


@pytest.mark.parametrize("arch", ARCHS)
async def test_concurrent_requests_match_solo_runs(arch: str, engine_factory: Factory) -> None:
    solo_engine = engine_factory(arch)
    lengths = [3, 17, 40, 64, 5, 90, 33, 16]
    prompts = [prompt_of(solo_engine, n, seed=i) for i, n in enumerate(lengths)]
    solo = [await greedy_tokens(solo_engine, p, 24, rid=f"s{i}", salt=f"s{i}") for i, p in enumerate(prompts)]
    batched_engine = engine_factory(arch, chunk_tokens=64)
    batched = await asyncio.gather(
        *(greedy_tokens(batched_engine, p, 24, rid=f"b{i}") for i, p in enumerate(prompts))
    )
    assert list(batched) == solo
    # Batching really happened: far fewer steps than one per token per request.
    assert batched_engine.stats().extra["steps"] < sum(len(t) for t in solo) // 2


async def test_prefix_cache_hit_computes_fewer_tokens(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    prompt = prompt_of(engine, 100)
    first = await greedy_tokens(engine, prompt, 16, rid="a")
    s1 = engine.stats()
    assert s1.prompt_tokens_computed == 100 and s1.prompt_tokens_cached == 0
    second = await greedy_tokens(engine, prompt, 16, rid="b")
    s2 = engine.stats()
    assert second == first
    assert s2.prompt_tokens_cached == 96  # six full pages; the partial last page is recomputed
    assert s2.prompt_tokens_computed - s1.prompt_tokens_computed == 4
    # Another tenant salt never sees those pages.
    third = await greedy_tokens(engine, prompt, 16, rid="c", salt="tenant-b")
    assert third == first
    assert engine.stats().prompt_tokens_cached == 96
    prefill = await engine.prefill("p", [*prompt, 7, 8, 9], Sampling(max_tokens=4))
    assert prefill.cached_tokens == 96 and prefill.prompt_tokens == 103
    engine.release_pages("p")
    _all_pages_free(engine)


async def test_lru_eviction_reuses_cached_pages(engine_factory: Factory) -> None:
    engine = engine_factory("qwen3", num_pages=16)
    for i in range(6):  # each request leaves ~5 cached pages behind; the pool only has 16
        await greedy_tokens(engine, prompt_of(engine, 70, seed=i), 8, rid=f"r{i}", salt=str(i))
    s = engine.stats()
    assert s.extra["evictions"] > 0 and s.pages_free == 16


async def test_abort_at_random_points_frees_every_page(engine_factory: Factory) -> None:
    engine = engine_factory("llama", num_pages=64, chunk_tokens=32)
    rng = random.Random(0)

    async def run(i: int) -> FinishReason | None:
        prompt = prompt_of(engine, rng.randint(1, 120), seed=i)
        stop_after = rng.randint(0, 20)
        if stop_after == 0:
            task = asyncio.ensure_future(collect(engine.generate(f"r{i}", prompt, Sampling(max_tokens=30))))
            await asyncio.sleep(rng.random() * 0.01)
            await engine.abort(f"r{i}")
            events = await task
            return events[-1].finish if events else None
        n = 0
        async for ev in engine.generate(f"r{i}", prompt, Sampling(max_tokens=30, ignore_eos=True)):
            n += 1
            if n == stop_after:
                if i % 2:
                    await engine.abort(f"r{i}")  # the stream then ends with ABORT
                else:
                    break  # leaving the stream aborts the request too
            if ev.finish is not None:
                return ev.finish
        return None

    finishes = await asyncio.gather(*(run(i) for i in range(24)))
    assert FinishReason.ABORT in finishes
    await _wait_idle(engine)
    _all_pages_free(engine)


async def test_preemption_keeps_outputs(engine_factory: Factory) -> None:
    roomy = engine_factory("llama")
    prompts = [prompt_of(roomy, 30 + 7 * i, seed=i) for i in range(4)]
    solo = [await greedy_tokens(roomy, p, 40, rid=f"s{i}", salt=f"{i}") for i, p in enumerate(prompts)]
    tight = engine_factory("llama", num_pages=12)  # 192 slots for 4 x ~90 tokens
    got = await asyncio.gather(*(greedy_tokens(tight, p, 40, rid=f"t{i}") for i, p in enumerate(prompts)))
    assert list(got) == solo
    assert tight.stats().extra["preemptions"] > 0
    _all_pages_free(tight)


async def test_out_of_pages_and_context_limit(engine_factory: Factory) -> None:
    engine = engine_factory("llama", num_pages=8)  # 128 slots
    held = engine.reserve_pages("hold", 100)
    assert len(held) == 7 and engine.stats().pages_pinned == 7
    with pytest.raises(OutOfPagesError):
        engine.reserve_pages("more", 40)
    with pytest.raises(OutOfPagesError):
        await collect(engine.generate("big", prompt_of(engine, 40), Sampling(max_tokens=4)))
    engine.release_pages("hold")
    events = await collect(
        engine.generate("long", prompt_of(engine, 60), Sampling(max_tokens=500, ignore_eos=True))
    )
    assert len(events) == 128 - 60 and events[-1].finish is FinishReason.LENGTH
    with pytest.raises(InvalidRequestError):  # a prompt cannot fill the whole context
        engine.generate("huge", prompt_of(engine, 130), Sampling())
    _all_pages_free(engine)


async def test_stop_rules(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    prompt = prompt_of(engine, 20)
    free = await collect(engine.generate("a", prompt, Sampling(max_tokens=24, ignore_eos=True)))
    ids = [e.token_id for e in free]
    text = "".join(e.text for e in free)
    assert text == engine.tokenizer.decode(ids)
    assert free[-1].finish is FinishReason.LENGTH and len(free) == 24

    stop_id = ids[5]
    by_id = await collect(engine.generate("b", prompt, Sampling(max_tokens=24, stop_token_ids=(stop_id,))))
    assert [e.token_id for e in by_id] == ids[: ids.index(stop_id) + 1]
    assert by_id[-1].finish is FinishReason.STOP

    eos = next(iter(engine.eos_token_ids))
    engine.eos_token_ids = frozenset({ids[3]})
    by_eos = await collect(engine.generate("c", prompt, Sampling(max_tokens=24)))
    assert len(by_eos) == ids.index(ids[3]) + 1 and by_eos[-1].finish is FinishReason.STOP
    ignored = await collect(engine.generate("d", prompt, Sampling(max_tokens=24, ignore_eos=True)))
    assert [e.token_id for e in ignored] == ids
    engine.eos_token_ids = frozenset({eos})

    stop = text[len(text) // 2 : len(text) // 2 + 3]
    by_str = await collect(engine.generate("e", prompt, Sampling(max_tokens=24, stop=(stop,))))
    out = "".join(e.text for e in by_str)
    assert by_str[-1].finish is FinishReason.STOP
    assert stop not in out and out == text[: text.index(stop)]


async def test_sampling_is_seeded_and_logprobs_are_right(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    prompt = prompt_of(engine, 12)
    hot = Sampling(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    a = await collect(engine.generate("a", prompt, hot))
    b = await collect(engine.generate("b", prompt, hot))
    c = await collect(engine.generate("c", prompt, Sampling(**{**hot.__dict__, "seed": 7})))
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert [e.token_id for e in a] != [e.token_id for e in c]
    greedy = await greedy_tokens(engine, prompt, 16, rid="g")
    top1 = await collect(
        engine.generate("k", prompt, Sampling(max_tokens=16, temperature=2.0, top_k=1, ignore_eos=True))
    )
    assert [e.token_id for e in top1] == greedy
    # The reported logprob is the model's own: check the first token against a direct forward.
    first = (await collect(engine.generate("l", prompt, Sampling(max_tokens=1))))[0]
    from .test_hf_equivalence import _our_logits

    logits = _our_logits(engine.model_dir, torch.tensor(prompt))[-1]
    assert abs(torch.log_softmax(logits, -1)[first.token_id].item() - first.logprob) < 1e-4


async def test_seeded_run_resumed_at_the_advanced_seed_continues_it(engine_factory: Factory) -> None:
    """Token i of a seeded request draws from `step_seed(seed, i)`: a request resumed after k tokens with
    prompt + those tokens and `advance_seed(seed, k)` samples the rest of the same run (migration)."""
    engine = engine_factory("qwen2")
    prompt = prompt_of(engine, 20)
    hot = Sampling(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    whole = [e.token_id for e in await collect(engine.generate("w", prompt, hot))]
    for k in (1, 7, 23):
        later = Sampling(**{**hot.__dict__, "max_tokens": 24 - k, "seed": advance_seed(99, k)})
        rest = [e.token_id for e in await collect(engine.generate(f"r{k}", prompt + whole[:k], later))]
        assert whole[:k] + rest == whole, k
    assert advance_seed(99, 3) != 99 + 3 and step_seed(advance_seed(99, 3), 2) == step_seed(99, 5)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (Sampling(max_tokens=0), "max_tokens"),
        (Sampling(max_tokens=MAX_TOKENS + 1), "max_tokens"),
        (Sampling(temperature=-1.0), "temperature"),
        (Sampling(temperature=2.5), "temperature"),
        (Sampling(temperature=float("nan")), "temperature"),
        (Sampling(top_p=0.0), "top_p"),
        (Sampling(top_k=-2), "top_k"),
        (Sampling(top_k=10**6), "top_k"),
        (Sampling(seed=-1), "seed"),
        (Sampling(stop=("",)), "stop"),
        (Sampling(stop_token_ids=tuple(range(65))), "stop_token_ids"),
    ],
)
async def test_invalid_sampling_is_rejected(sampling: Sampling, field: str, engine_factory: Factory) -> None:
    engine = engine_factory("qwen2")
    with pytest.raises(SamplingError) as err:
        engine.generate("x", [1, 2, 3], sampling)
    assert err.value.field == field
    with pytest.raises(SamplingError):
        await engine.prefill("x", [1, 2, 3], sampling)
    with pytest.raises(SamplingError, match="cache_salt"):
        engine.generate("x", [1, 2, 3], Sampling(), cache_salt="s" * 257)
    _all_pages_free(engine)


async def test_an_aborted_stream_ends_with_an_abort_event(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    stream = engine.generate("r", prompt_of(engine, 8), Sampling(max_tokens=200, ignore_eos=True))
    events = [await stream.__anext__()]
    await engine.abort("r")
    events += [ev async for ev in stream]
    assert all(isinstance(ev, TokenEvent) for ev in events[:-1])
    assert events[-1] == AbortEvent() and events[-1].finish is FinishReason.ABORT
    await _wait_idle(engine)
    _all_pages_free(engine)


async def test_invalid_prompts_and_duplicate_ids(engine_factory: Factory) -> None:
    engine = engine_factory("qwen2")
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate("x", [], Sampling())
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        await engine.prefill("x", [1, 10_000], Sampling())
    await engine.prefill("dup", [1, 2, 3], Sampling())
    with pytest.raises(InvalidRequestError, match="in use"):
        await engine.prefill("dup", [1, 2, 3], Sampling())
    engine.release_pages("dup")
    engine.release_pages("dup")  # idempotent
    _all_pages_free(engine)


async def test_chat_template_and_detokenization(engine_factory: Factory) -> None:
    engine = engine_factory("qwen3")
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi 🙂 café"}])
    assert text == "<|im_start|>user\nHi 🙂 café<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token_id in engine.eos_token_ids


def _first_token_readings() -> tuple[float, dict[str, float]]:
    """The process's `xavier_engine_first_tokens` and `..._first_token_seconds{phase}` so far."""
    reg = get_registry()
    count = reg.get_sample_value("xavier_engine_first_tokens_total") or 0.0
    return count, {
        ph: reg.get_sample_value("xavier_engine_first_token_seconds_total", {"phase": ph}) or 0.0
        for ph in PHASES
    }


async def test_first_token_phases_add_up_per_streamed_request(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    n0, s0 = _first_token_readings()
    await greedy_tokens(engine, prompt_of(engine, 100), 4, rid="timed")
    n1, s1 = _first_token_readings()
    spent = {ph: s1[ph] - s0[ph] for ph in PHASES}
    assert n1 - n0 == 1  # one request streamed its first token
    assert all(v >= 0 for v in spent.values()) and spent["compute"] > 0
    parts = spent["prefix"] + spent["queue"] + spent["compute"] + spent["handback"]
    assert parts == pytest.approx(spent["total"], rel=1e-6, abs=1e-9)
    # A prefill's first token is its answer, not a stream's: it counts nothing.
    await engine.prefill("p", prompt_of(engine, 40, seed=3), Sampling(max_tokens=4))
    engine.release_pages("p")
    assert _first_token_readings()[0] == n1
