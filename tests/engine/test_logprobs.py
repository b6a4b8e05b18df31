"""Prompt logprobs and top-N alternatives of the reference engine, against transformers' forward pass of
the same tiny checkpoint: over chunked prefills, in the prefill role, and next to the prefix cache (a
request that wants its prompt's logprobs computes the whole prompt; one that does not still hits)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from xavier_core.engine.api import PromptLogprobs, Sampling, TokenEvent
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.sampling import SamplingError

from .conftest import collect, prompt_of

transformers = pytest.importorskip("transformers")
Factory = Callable[..., ReferenceEngine]
_TOL = 1e-4


def _rows(path: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)


def _check_prompt(prompt: PromptLogprobs, ids: list[int], rows: torch.Tensor, n: int) -> None:
    assert len(prompt.logprobs) == len(ids) - 1 and len(prompt.top) == (len(ids) - 1 if n else 0)
    for i, value in enumerate(prompt.logprobs):
        assert value == pytest.approx(float(rows[i, ids[i + 1]]), abs=_TOL)
    for i, top in enumerate(prompt.top):
        values, _ = torch.topk(rows[i], n)
        assert list(top.logprobs) == [pytest.approx(float(v), abs=_TOL) for v in values]
        assert all(
            float(rows[i, t]) == pytest.approx(v, abs=_TOL)
            for t, v in zip(top.token_ids, top.logprobs, strict=True)
        )


@pytest.mark.parametrize("chunk_tokens", [5, 1024])
async def test_generate_prompt_and_top_logprobs(
    engine_factory: Factory, tiny_dirs: dict[str, Path], chunk_tokens: int
) -> None:
    engine = engine_factory("qwen3", chunk_tokens=chunk_tokens)
    prompt = prompt_of(engine, 23)
    sampling = Sampling(max_tokens=4, ignore_eos=True, top_logprobs=3, prompt_logprobs=True)
    events = await collect(engine.generate("a", prompt, sampling))
    ids = prompt + [e.token_id for e in events]
    rows = _rows(tiny_dirs["qwen3"], ids)
    assert events[0].prompt is not None and all(e.prompt is None for e in events[1:])
    _check_prompt(events[0].prompt, prompt, rows, 3)
    for k, event in enumerate(events):
        at = len(prompt) - 1 + k
        assert event.logprob == pytest.approx(float(rows[at, event.token_id]), abs=_TOL)
        assert event.top is not None and event.top.token_ids[0] == event.token_id  # greedy: the argmax
        assert list(event.top.logprobs) == [
            pytest.approx(float(v), abs=_TOL) for v in torch.topk(rows[at], 3)[0]
        ]


async def test_prompt_logprobs_bypass_the_prefix_cache_only_for_their_request(
    engine_factory: Factory,
) -> None:
    engine = engine_factory("llama", page_size=4)
    prompt = prompt_of(engine, 30)
    plain = Sampling(max_tokens=2, ignore_eos=True)
    first = await collect(engine.generate("warm", prompt, plain))
    assert first[0].top is None and first[0].prompt is None  # nothing asked, nothing computed
    hit = await collect(engine.generate("hit", prompt, plain))
    assert hit[0].cached_tokens > 0
    want = Sampling(max_tokens=2, ignore_eos=True, prompt_logprobs=True)
    full = await collect(engine.generate("full", prompt, want))
    assert full[0].cached_tokens == 0 and full[0].prompt is not None
    assert len(full[0].prompt.logprobs) == len(prompt) - 1 and full[0].prompt.top == ()
    assert [e.token_id for e in full] == [e.token_id for e in first]


async def test_prefill_role_returns_them(engine_factory: Factory, tiny_dirs: dict[str, Path]) -> None:
    engine = engine_factory("qwen2")
    prompt = prompt_of(engine, 17)
    sampling = Sampling(max_tokens=3, top_logprobs=2, prompt_logprobs=True)
    res = await engine.prefill("p", prompt, sampling)
    engine.release_pages("p")
    rows = _rows(tiny_dirs["qwen2"], prompt)
    assert res.prompt_logprobs is not None and res.first_top is not None
    _check_prompt(res.prompt_logprobs, prompt, rows, 2)
    assert res.first_top.token_ids[0] == res.first_token == int(rows[-1].argmax())
    # A decode continuing from the first token reports no prompt logprobs (the prefill did).
    pages = engine.reserve_pages("d", len(prompt))
    assert pages
    events = await collect(
        engine.decode_from_pages("d", prompt, res.first_token, res.first_logprob, sampling)
    )
    assert all(isinstance(e, TokenEvent) and e.prompt is None for e in events)


def test_top_logprobs_limit() -> None:
    with pytest.raises(SamplingError) as err:
        Sampling(top_logprobs=21).check()
    assert err.value.field == "top_logprobs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_cuda_with_decode_graphs(engine_factory: Factory, tiny_dirs: dict[str, Path]) -> None:
    """The prompt rows run in the general forward, the later tokens' alternatives from the decode graphs'
    logits; float32 keeps the comparison with transformers on the CPU tight."""
    engine = engine_factory("llama", device="cuda", dtype="float32", chunk_tokens=8)
    assert engine.capture_decode_graphs() > 0
    prompt = prompt_of(engine, 21)
    sampling = Sampling(max_tokens=6, ignore_eos=True, top_logprobs=5, prompt_logprobs=True)
    events = await collect(engine.generate("g", prompt, sampling))
    ids = prompt + [e.token_id for e in events]
    rows = _rows(tiny_dirs["llama"], ids)
    assert events[0].prompt is not None
    _check_prompt(events[0].prompt, prompt, rows, 5)
    for k, event in enumerate(events):
        at = len(prompt) - 1 + k
        assert event.top is not None and event.top.token_ids[0] == event.token_id
        assert list(event.top.logprobs) == [
            pytest.approx(float(v), abs=1e-3) for v in torch.topk(rows[at], 5)[0]
        ]
    assert engine.stats().extra["decode_graphs"] > 0
