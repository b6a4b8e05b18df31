"""Short prefill chunks after cached keys run as decode rows (`DecodeRunner`, `decode_static` eagerly on
the CPU, float32): the same logits, K/V and greedy tokens as the general forward, alone or batched with
decode rows, across a page boundary, with padded rows and page tables."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
import torch

from xavier_core.engine.api import Sampling, TokenEvent
from xavier_core.engine.decode_graph import CHUNK_GATHER_BYTES, DecodeRunner
from xavier_core.engine.kv_pool import KvPool
from xavier_core.engine.model import CausalLM
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.request import Request, Role
from xavier_core.engine.runner import build_batch
from xavier_core.engine.scheduler import StepPlan

from .conftest import ARCHS, collect, prompt_of

Factory = Callable[..., ReferenceEngine]
Items = list[tuple[Request, int]]
_ATOL = 1e-4  # what the static decode tests allow (test_decode_static)


def _request(
    engine: ReferenceEngine, rid: str, prompt: list[int], pages: list[int], prompt_logprobs: bool = False
) -> Request:
    return Request(
        id=rid,
        prompt=prompt,
        sampling=Sampling(max_tokens=16, ignore_eos=True, prompt_logprobs=prompt_logprobs),
        role=Role.GENERATE,
        deliver=lambda _: None,
        tokenizer=engine.tokenizer,
        eos_ids=frozenset(),
        max_context=engine.max_context,
        pages=pages,
    )


def _general(model: CausalLM, pool: KvPool, items: Items) -> torch.Tensor:
    return model.forward(build_batch(StepPlan(list(items)), pool.page_size, pool.device, []), pool)


def _advance(items: Items, logits: torch.Tensor) -> None:
    """What `Scheduler.complete` does to these requests: the tokens computed, a greedy token for each
    request that sampled."""
    tokens = iter(logits.argmax(-1).tolist())
    for req, n in items:
        req.num_computed += n
        if req.num_computed == len(req.tokens):
            req.tokens.append(next(tokens))


def _twins(engine: ReferenceEngine, specs: Sequence[tuple[int, int, list[int]]]) -> tuple[Items, Items]:
    """Two copies of each request (prompt length, tokens already computed, pages): one per pool."""
    copies: tuple[Items, Items] = ([], [])
    for i, (length, done, pages) in enumerate(specs):
        prompt = prompt_of(engine, length, seed=i)
        for items in copies:
            req = _request(engine, f"r{i}", prompt, list(pages))
            items.append((req, done))
    return copies


# (prompt length, tokens cached before the step, pages). Row totals pad to the next row bucket and page
# lists to the next page bucket (4, 8) in every case.
_CASES = {
    # A prefix hit: two cached pages, 13 new tokens on the third (13 rows pad to 16).
    "prefix_hit": [(45, 32, [9, 3, 6, 17])],
    # A chunk after a chunk: positions 27..39 cross from the second page to the third.
    "page_boundary": [(40, 27, [4, 11, 2])],
    # Decode rows first (as the scheduler orders them), then two chunks: 1 + 1 + 13 + 13 rows pad to 32,
    # the last request's five pages to a page bucket of eight.
    "mixed": [(20, 20, [1, 5]), (33, 33, [7, 8, 0]), (45, 32, [9, 3, 6, 17]), (70, 57, [10, 12, 13, 14, 15])],
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("arch", ARCHS)
def test_chunk_rows_equal_the_general_forward(arch: str, case: str, engine_factory: Factory) -> None:
    _check_rows(engine_factory(arch), case)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_compiled_rows_equal_the_general_forward(case: str, engine_factory: Factory) -> None:
    """The step `CausalLM.compiled_layer` traces (shapes symbolic, the pool's K/V written in place) gives
    what the general forward gives, over the buckets these steps take. The CPU has no use for a compiled
    step, so the trace runs as is (torch.compile's aot_eager backend); CUDA runs inductor's kernels
    (tests/engine/test_gpu.py)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compiled anew here, not served from an earlier case's compilations
    before = counters["stats"]["unique_graphs"]
    _check_rows(engine_factory("qwen3"), case, compiled="aot_eager")
    assert counters["stats"]["unique_graphs"] > before  # compiled, not run eagerly in its place


def _check_rows(engine: ReferenceEngine, case: str, compiled: str = "") -> None:
    model = engine.model
    assert isinstance(model, CausalLM)
    cfg = model.cfg
    ref = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 32, torch.float32, "cpu")
    general, static = _twins(engine, _CASES[case])
    # The cached prefix (and the decode rows' prompts) through the general forward, copied to a twin pool.
    prefix = [(req, done) for req, done in general if done]
    _general(model, ref, prefix)
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 32, torch.float32, "cpu")
    for dst, src in zip(pool.buffers(), ref.buffers(), strict=True):
        dst.copy_(src)
    for items in (general, static):
        for req, done in items:
            req.num_computed = done
            if done == len(req.prompt):  # a request in decode: its first token
                req.tokens.append(req.prompt[0])
    runner = DecodeRunner(model, pool, use_graphs=False, max_rows=32, compiled=compiled)

    def step(g: Items, s: Items) -> None:
        assert runner.accepts(s)
        want, got = _general(model, ref, g), runner.run(s)
        assert want.shape == got.shape and want.abs().max() > 1.0
        torch.testing.assert_close(got, want, atol=_ATOL, rtol=0)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for a, b in zip(pool.buffers(), ref.buffers(), strict=True):  # every row's K/V, padding's too
            torch.testing.assert_close(a, b, atol=_ATOL, rtol=0)
        _advance(g, want)
        _advance(s, got)

    step([(r, r.remaining) for r, _ in general], [(r, r.remaining) for r, _ in static])
    assert runner.prefill_chunks == sum(1 for r, done in static if done < len(r.prompt))
    assert runner.shared_steps == (len(static) == 1)  # a chunk alone gathers its keys once
    for _ in range(6):  # greedy decode over the pages the chunk rows wrote
        step([(r, 1) for r, _ in general], [(r, 1) for r, _ in static])
    assert [r.tokens for r, _ in static] == [r.tokens for r, _ in general]


def test_which_steps_take_the_rows(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    model = engine.model
    assert isinstance(model, CausalLM)
    runner = DecodeRunner(model, engine.kv_pool, use_graphs=False, max_rows=8)
    assert runner.max_rows == 8
    prompt = prompt_of(engine, 40)
    pages = [0, 1, 2]

    def item(done: int, n: int, prompt_logprobs: bool = False) -> tuple[Request, int]:
        req = _request(engine, "r", prompt, pages, prompt_logprobs)
        req.num_computed = done
        return req, n

    decode = _request(engine, "d", prompt, pages)
    decode.num_computed = 39
    assert runner.accepts([(decode, 1)])
    assert runner.accepts([(decode, 1), item(32, 7)])  # a mixed step of eight rows
    assert runner.accepts([item(32, 3)])  # a chunk that does not reach the prompt's end samples nothing
    assert not runner.accepts([(decode, 1), item(31, 8)])  # nine rows: past the largest row bucket
    assert not runner.accepts([item(0, 8)])  # a cold first chunk: no cached keys before its queries
    assert not runner.accepts([item(32, 8, prompt_logprobs=True)])  # wants every row's logits
    assert not runner.accepts([])
    runner.chunks = False
    assert runner.accepts([(decode, 1)]) and not runner.accepts([item(32, 8)])


def test_a_chunk_whose_rows_would_gather_too_much_takes_the_general_forward(engine_factory: Factory) -> None:
    """Beside other requests' rows each row of a chunk gathers the request's keys again; alone in its step
    the chunk gathers them once (a shared table). Past `chunk_gather_bytes` per layer the chunk takes the
    general forward, which gathers them once. Decode rows are never held to it."""
    engine = engine_factory("llama")
    model = engine.model
    assert isinstance(model, CausalLM)
    pool = engine.kv_pool
    k = pool.k[0]
    key_bytes = 2 * k[0].numel() * k.element_size()
    prompt = prompt_of(engine, 40)
    chunk = _request(engine, "r", prompt, [0, 1, 2])
    chunk.num_computed = 32  # positions 32-39: 3 pages, the 4-page floor bucket
    decode = _request(engine, "d", prompt, [0, 1, 2])
    decode.num_computed = 39
    alone, beside = 4 * pool.page_size * key_bytes, 8 * 4 * pool.page_size * key_bytes
    runner = DecodeRunner(model, pool, use_graphs=False, max_rows=8)
    assert runner.gather_bytes((8, 4, True)) == alone and runner.gather_bytes((8, 4, False)) == beside
    runner.chunk_gather_bytes = beside
    assert runner.accepts([(chunk, 8)]) and runner.accepts([(decode, 1), (chunk, 7)])
    runner.chunk_gather_bytes = beside - 1
    assert runner.accepts([(chunk, 8)]) and not runner.accepts([(decode, 1), (chunk, 7)])
    runner.chunk_gather_bytes = alone - 1
    assert not runner.accepts([(chunk, 8)])
    runner.chunk_gather_bytes = 0  # decode rows are not held to it
    assert runner.accepts([(decode, 1)]) and not runner.accepts([(chunk, 8)])


def test_the_configs_gather_bound_is_the_runners_default() -> None:
    """`engine.chunk_gather_bytes` repeats the runner's default (the config module imports no torch)."""
    from xavier_services.peer.config import EngineSection

    assert EngineSection().chunk_gather_bytes == CHUNK_GATHER_BYTES


Served = list[tuple[int, float, int]]  # (token, logprob, cached tokens) of each event


async def _served(engine: ReferenceEngine, rid: str, prompt: list[int], n: int) -> Served:
    events = await collect(engine.generate(rid, prompt, Sampling(max_tokens=n, ignore_eos=True)))
    return [(e.token_id, e.logprob, e.cached_tokens) for e in events]


async def _serve(engine: ReferenceEngine, prompts: list[list[int]], long: list[int]) -> list[Served]:
    """The first two prompts one after the other; then the last one sent once `long` has its first token,
    so its suffix shares a step with `long`'s decode row."""
    out = [await _served(engine, f"p{i}", p, 8) for i, p in enumerate(prompts[:2])]
    stream = engine.generate("long", long, Sampling(max_tokens=24, ignore_eos=True))
    first = await anext(stream)
    assert isinstance(first, TokenEvent)
    late = asyncio.create_task(_served(engine, "late", prompts[2], 8))
    rest = await collect(stream)
    out.append(await late)
    out.append([(e.token_id, e.logprob, e.cached_tokens) for e in (first, *rest)])
    return out


@pytest.mark.parametrize("arch", ARCHS)
async def test_a_prefix_hit_yields_the_same_tokens_with_and_without_chunk_rows(
    arch: str, engine_factory: Factory
) -> None:
    """Engine level: the second and third prompts take the first one's cached pages, the third while
    another request decodes."""
    results, runners = {}, {}
    for chunks in (False, True):
        engine = engine_factory(arch, chunk_tokens=64)
        assert isinstance(engine.model, CausalLM)
        engine._loop.decoder = runners[chunks] = DecodeRunner(
            engine.model, engine.kv_pool, use_graphs=False, max_rows=32, chunks=chunks
        )
        shared = prompt_of(engine, 48, seed=3)
        prompts = [shared + prompt_of(engine, n, seed=n) for n in (5, 20, 11)]
        results[chunks] = await _serve(engine, prompts, prompt_of(engine, 30, seed=1))
    for want, got in zip(results[False], results[True], strict=True):
        assert [t for t, _, _ in got] == [t for t, _, _ in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=_ATOL)
    assert [r[0][2] for r in results[True]] == [0, 48, 48, 0]  # the prefix hits
    # The second and third suffixes ran as rows: the second alone (one shared page table), the third
    # beside the long request's decode row (a table per row).
    assert runners[True].prefill_chunks == 2 and runners[False].prefill_chunks == 0
    assert runners[True].shared_steps == 1


async def test_prompt_logprobs_keep_the_general_forward(engine_factory: Factory) -> None:
    """Chunks after the first that want their prompt's logprobs are not taken; the logprobs equal a plain
    engine's."""
    plain = engine_factory("qwen2", chunk_tokens=8)
    engine = engine_factory("qwen2", chunk_tokens=8)
    assert isinstance(engine.model, CausalLM)
    runner = DecodeRunner(engine.model, engine.kv_pool, use_graphs=False, max_rows=32)
    engine._loop.decoder = runner
    prompt = prompt_of(engine, 21)
    sampling = Sampling(max_tokens=4, ignore_eos=True, prompt_logprobs=True)
    want = await collect(plain.generate("p", prompt, sampling))
    got = await collect(engine.generate("p", prompt, sampling))
    assert runner.prefill_chunks == 0 and runner.steps == 3  # the decode steps after the first token
    assert got[0].prompt is not None and want[0].prompt is not None
    assert list(got[0].prompt.logprobs) == pytest.approx(list(want[0].prompt.logprobs), abs=_ATOL)
    assert [e.token_id for e in got] == [e.token_id for e in want]
    assert engine.stats().extra["static_prefill_chunks"] == 0
