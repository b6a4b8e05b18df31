"""Prefill on one engine, page copy, decode on another: the same tokens as a unified run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from xavier_core.engine.api import FinishReason, InvalidRequestError, RequestNotFoundError, Sampling
from xavier_core.engine.reference import ReferenceEngine

from .conftest import ARCHS, collect, greedy_tokens, pd_events, prompt_of

Factory = Callable[..., ReferenceEngine]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("copy", ["tensors", "bytes"])
async def test_prefill_transfer_decode_equals_generate(arch: str, copy: str, engine_factory: Factory) -> None:
    prefill_engine = engine_factory(arch, chunk_tokens=32)
    decode_engine = engine_factory(arch)
    prompt = prompt_of(prefill_engine, 75)
    expected = await greedy_tokens(prefill_engine, prompt, 32, rid="ref", salt="ref")

    sampling = Sampling(max_tokens=32, ignore_eos=True)
    res = await prefill_engine.prefill("req", prompt, sampling)
    assert res.first_token == expected[0] and res.prompt_tokens == 75 and res.cached_tokens == 0
    assert len(res.page_ids) == 5 and res.finish is None
    assert prefill_engine.stats().pages_pinned == 5

    dst = decode_engine.reserve_pages("req", len(prompt))
    assert len(dst) == 5
    if copy == "tensors":
        decode_engine.kv_pool.copy_pages_from(prefill_engine.kv_pool, res.page_ids, dst)
    else:
        decode_engine.write_pages(dst, prefill_engine.read_pages(res.page_ids))
    assert decode_engine.read_pages(dst) == prefill_engine.read_pages(res.page_ids)
    prefill_engine.release_pages("req")
    prefill_engine.release_pages("req")
    assert prefill_engine.stats().pages_pinned == 0

    events = await collect(
        decode_engine.decode_from_pages("req", prompt, res.first_token, res.first_logprob, sampling)
    )
    assert events[0].token_id == res.first_token and events[0].logprob == res.first_logprob
    assert [e.token_id for e in events] == expected
    assert events[-1].finish is FinishReason.LENGTH
    s = decode_engine.stats()
    assert s.pages_free == s.pages_total and s.pages_pinned == 0 and s.prompt_tokens_computed == 0
    decode_engine.release_pages("req")  # after the decode finished: a no-op


async def test_seeded_prefill_then_decode_equals_seeded_generate(engine_factory: Factory) -> None:
    """Each token's draw depends on the seed and its position only, so a decode (whose first token the
    prefill sampled) continues the run one engine would sample."""
    prefill_engine, decode_engine = engine_factory("qwen2"), engine_factory("qwen2")
    prompt = prompt_of(prefill_engine, 30)
    hot = Sampling(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    expected = [e.token_id for e in await collect(prefill_engine.generate("ref", prompt, hot))]
    events = await pd_events(prefill_engine, decode_engine, "req", prompt, hot)
    assert [e.token_id for e in events] == expected


async def test_prefill_pages_hold_the_prompt_kv(engine_factory: Factory) -> None:
    a = engine_factory("qwen2")
    b = engine_factory("qwen2")
    prompt = prompt_of(a, 40)
    ra = await a.prefill("x", prompt, Sampling())
    rb = await b.prefill("x", prompt, Sampling())
    assert a.read_pages(ra.page_ids) == b.read_pages(rb.page_ids)
    size = len(a.read_pages(ra.page_ids[:1]))
    buffers = a.kv_buffers()
    assert len(buffers) == 2 * a.num_layers
    assert size == sum(buf.bytes_per_page for buf in buffers)
    assert all(buf.nbytes == buf.bytes_per_page * 256 for buf in buffers)
    assert buffers[0].bytes_per_page == a.page_size * a.num_kv_heads * a.head_dim * 4
    assert [buf.addr for buf in a.kv_buffers()] == [buf.addr for buf in buffers]  # never reallocated


async def test_prefill_that_finishes_at_once(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    prompt = prompt_of(engine, 20)
    res = await engine.prefill("one", prompt, Sampling(max_tokens=1))
    assert res.finish is FinishReason.LENGTH and len(res.page_ids) == 2
    first = await greedy_tokens(engine, prompt, 1, rid="g", salt="g")
    eos_engine = engine_factory("llama")
    eos_engine.eos_token_ids = frozenset({first[0]})
    res = await eos_engine.prefill("eos", prompt, Sampling(max_tokens=8))
    assert res.finish is FinishReason.STOP
    dst = eos_engine.reserve_pages("d", len(prompt))
    events = await collect(eos_engine.decode_from_pages("d", prompt, first[0], -0.5, Sampling(max_tokens=8)))
    assert len(events) == 1 and events[0].finish is FinishReason.STOP and len(dst) == 2
    eos_engine.release_pages("eos")
    assert eos_engine.stats().pages_free == eos_engine.stats().pages_total


async def test_decode_needs_a_matching_reservation(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    prompt = prompt_of(engine, 40)
    with pytest.raises(RequestNotFoundError):
        await collect(engine.decode_from_pages("none", prompt, 5, 0.0, Sampling()))
    engine.reserve_pages("short", 10)
    with pytest.raises(InvalidRequestError, match="reserved 1 pages"):
        await collect(engine.decode_from_pages("short", prompt, 5, 0.0, Sampling()))
    with pytest.raises(InvalidRequestError):
        engine.reserve_pages("zero", 0)
    engine.reserve_pages("dropped", 40)
    engine.release_pages("dropped")
    await engine.abort("dropped")
    s = engine.stats()
    assert s.pages_free == s.pages_total and s.pages_pinned == 0


async def test_abort_releases_a_pinned_prefill(engine_factory: Factory) -> None:
    engine = engine_factory("qwen3")
    await engine.prefill("p", prompt_of(engine, 33), Sampling())
    assert engine.stats().pages_pinned == 3
    await engine.abort("p")
    for _ in range(100):
        if engine.stats().pages_pinned == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().pages_pinned == 0


async def test_abort_of_what_the_loop_does_not_hold_needs_no_loop(
    engine_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished decode, a prefill's pinned pages and an unclaimed reservation are released at once by
    `abort`, without a word to the loop's thread; a request the loop holds still goes through it and ends
    with ABORT."""
    prefill_engine, decode_engine = engine_factory("qwen3"), engine_factory("qwen3")
    queued: list[str] = []
    for engine in (prefill_engine, decode_engine):
        real = engine._loop.queue_abort

        def record(request_id: str, real: Callable[[str], None] = real) -> None:
            queued.append(request_id)
            real(request_id)

        monkeypatch.setattr(engine._loop, "queue_abort", record)
    prompt = prompt_of(prefill_engine, 33)
    s = Sampling(max_tokens=3, ignore_eos=True)
    events = await pd_events(prefill_engine, decode_engine, "done", prompt, s)
    assert events[-1].finish is FinishReason.LENGTH
    await decode_engine.abort("done")
    await prefill_engine.prefill("pinned", prompt, Sampling())
    assert prefill_engine.stats().pages_pinned == 3
    await prefill_engine.abort("pinned")
    assert prefill_engine.stats().pages_pinned == 0
    decode_engine.reserve_pages("reserved", 40)
    await decode_engine.abort("reserved")
    assert decode_engine.stats().pages_pinned == 0 and queued == []

    live = decode_engine.generate("live", prompt, Sampling(max_tokens=10_000, ignore_eos=True))
    assert (await anext(live)).finish is None
    await decode_engine.abort("live")
    assert queued == ["live"]
    rest = await collect(live)
    assert rest[-1].finish is FinishReason.ABORT
    stats = decode_engine.stats()
    assert stats.pages_pinned == 0 and stats.pages_free == stats.pages_total


async def test_quarantined_pages_are_never_handed_out_again(engine_factory: Factory) -> None:
    """A decode whose read into its reserved pages may still be running keeps them out of use for good:
    the abort and release that follow free nothing, and no later allocation gets them."""
    engine = engine_factory("llama")
    total = engine.stats().pages_total
    stuck = set(engine.reserve_pages("stuck", 40))
    assert engine.quarantine_pages("stuck") == len(stuck) and engine.quarantine_pages("stuck") == 0
    await engine.abort("stuck")
    engine.release_pages("stuck")
    await asyncio.sleep(0.05)  # the loop applies the abort
    s = engine.stats()
    assert s.pages_free == total - len(stuck) and s.pages_pinned == 0
    assert s.pages_quarantined == len(stuck)
    # Every page the pool can still give, taken at once: none of the quarantined ones among them.
    rest = engine.reserve_pages("rest", (total - len(stuck)) * engine.page_size - 1)
    assert not stuck & set(rest)
    engine.release_pages("rest")


async def test_quarantined_pages_come_back_once_the_read_ends(engine_factory: Factory) -> None:
    """With the read's end to wait for (`until`), the pages stay out of use until it completes, then go
    back to the pool; a wait that fails or is cancelled keeps them out for good."""
    engine = engine_factory("llama")
    total = engine.stats().pages_total
    loop = asyncio.get_running_loop()
    ended, broken, cancelled = loop.create_future(), loop.create_future(), loop.create_future()
    sizes = {}
    for rid, until in (("ends", ended), ("breaks", broken), ("cancelled", cancelled)):
        sizes[rid] = len(engine.reserve_pages(rid, 40))
        assert engine.quarantine_pages(rid, until=until) == sizes[rid]
    held = sum(sizes.values())
    assert engine.stats().pages_quarantined == held and engine.stats().pages_free == total - held
    ended.set_result(None)
    broken.set_exception(RuntimeError("the port closed"))
    cancelled.cancel()
    await asyncio.sleep(0)  # the futures' callbacks run
    s = engine.stats()
    kept = sizes["breaks"] + sizes["cancelled"]
    assert s.pages_quarantined == kept and s.pages_free == total - kept
