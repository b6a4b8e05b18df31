"""CUDA runs: float16 greedy tokens follow a float32 CPU reference on the tiny checkpoints, and decode
replayed from CUDA graphs follows the same static-shape decode run eagerly.

Float16 rounding may flip an argmax where the float32 model itself hesitates, so a divergence is accepted
only at a step where the reference's top two logits are within `_NEAR_TIE`; anywhere else it is a bug.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from xavier_core.engine.api import Sampling
from xavier_core.engine.reference import ReferenceEngine

from .conftest import ARCHS, collect, greedy_tokens, prompt_of
from .test_hf_equivalence import _our_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
_NEAR_TIE = 0.25


@pytest.mark.parametrize("arch", ARCHS)
async def test_fp16_cuda_greedy_follows_fp32_cpu(arch: str, tiny_dirs: dict[str, Path]) -> None:
    cpu = ReferenceEngine.load(tiny_dirs[arch], num_pages=64)
    gpu = ReferenceEngine.load(tiny_dirs[arch], device="cuda", num_pages=64)
    try:
        assert gpu.dtype_name == "float16" and gpu.kv_buffers()[0].device.startswith("cuda")
        for i, n in enumerate((9, 40, 70)):
            prompt = prompt_of(cpu, n, seed=i)
            want = await greedy_tokens(cpu, prompt, 32, rid=f"c{i}")
            got = await greedy_tokens(gpu, prompt, 32, rid=f"g{i}")
            _check_near_tie(tiny_dirs[arch], prompt, want, got)
    finally:
        await cpu.close()
        await gpu.close()


def _check_near_tie(model_dir: Path, prompt: list[int], want: list[int], got: list[int]) -> None:
    """Passes when `got == want` or they part where the float32 reference's top two logits nearly tie."""
    if got == want:
        return
    k = next(j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    logits = _our_logits(model_dir, torch.tensor(prompt + want[:k]))[-1]
    top2 = torch.topk(logits, 2).values
    assert float(top2[0] - top2[1]) < _NEAR_TIE, f"{model_dir.name}: diverged at {k} without a near tie"


async def _run_all(engine: ReferenceEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    sampling = Sampling(max_tokens=n, ignore_eos=True)
    streams = [collect(engine.generate(f"r{i}", p, sampling)) for i, p in enumerate(prompts)]
    return [[e.token_id for e in events] for events in await asyncio.gather(*streams)]


@pytest.mark.parametrize("arch", ARCHS)
async def test_cuda_graph_decode_equals_eager(arch: str, tiny_dirs: dict[str, Path]) -> None:
    graphed = ReferenceEngine.load(tiny_dirs[arch], device="cuda", num_pages=128, chunk_tokens=64)
    eager = ReferenceEngine.load(
        tiny_dirs[arch], device="cuda", num_pages=128, chunk_tokens=64, cuda_graphs=False
    )
    try:
        prompts = [prompt_of(eager, n, seed=i) for i, n in enumerate((3, 17, 60, 90, 33))]
        # One request at a time the batch shapes are the same in both engines: the replay must be exact.
        for i, prompt in enumerate(prompts[:2]):
            assert await greedy_tokens(graphed, prompt, 40, rid=f"g{i}") == await greedy_tokens(
                eager, prompt, 40, rid=f"e{i}"
            )
        # Together, padded to a bucket of eight rows; how requests group into steps may differ between runs.
        want = await _run_all(eager, prompts, 40)
        got = await _run_all(graphed, prompts, 40)
        for prompt, w, g in zip(prompts, want, got, strict=True):
            _check_near_tie(tiny_dirs[arch], prompt, w, g)
        assert graphed.stats().extra["decode_graphs"] >= 2
        assert eager.stats().extra["decode_graphs"] == 0
    finally:
        await graphed.close()
        await eager.close()


@pytest.mark.parametrize("arch", ARCHS)
async def test_chunked_and_prefix_hit_prefill_on_cuda_follow_fp32_cpu(
    arch: str, tiny_dirs: dict[str, Path]
) -> None:
    """Chunks after the first, and a prompt whose prefix is cached, attend over keys before their own
    queries (the lower-right causal mask): the tokens still follow the float32 CPU reference."""
    cpu = ReferenceEngine.load(tiny_dirs[arch], num_pages=64)
    gpu = ReferenceEngine.load(tiny_dirs[arch], device="cuda", num_pages=64, chunk_tokens=16)
    try:
        shared = prompt_of(cpu, 48, seed=7)
        for i, tail in enumerate((prompt_of(cpu, 5, seed=8), prompt_of(cpu, 21, seed=9))):
            prompt = shared + tail  # the second one hits the first one's cached pages
            want = await greedy_tokens(cpu, prompt, 24, rid=f"c{i}")
            sampling = Sampling(max_tokens=24, ignore_eos=True)
            events = await collect(gpu.generate(f"g{i}", prompt, sampling))
            assert (events[0].cached_tokens > 0) == (i == 1)  # the second prompt took the first's pages
            _check_near_tie(tiny_dirs[arch], prompt, want, [e.token_id for e in events])
    finally:
        await cpu.close()
        await gpu.close()


@pytest.mark.parametrize("arch", ARCHS)
async def test_prefix_hit_suffix_replays_the_decode_graphs(arch: str, tiny_dirs: dict[str, Path]) -> None:
    """A prefix hit's suffix runs as rows of a captured decode graph, alone and beside another request's
    decode row: the engine counts both chunks, and the tokens still follow the float32 CPU reference."""
    cpu = ReferenceEngine.load(tiny_dirs[arch], num_pages=64)
    gpu = ReferenceEngine.load(tiny_dirs[arch], device="cuda", num_pages=64, max_running=32)
    plain = ReferenceEngine.load(tiny_dirs[arch], device="cuda", num_pages=64, static_chunks=False)
    try:
        assert gpu.capture_decode_graphs() > 0 and plain.capture_decode_graphs() > 0
        shared = prompt_of(cpu, 48, seed=7)
        prompts = [shared + prompt_of(cpu, n, seed=n) for n in (5, 21, 11)]
        for i, prompt in enumerate(prompts[:2]):
            want = await greedy_tokens(cpu, prompt, 24, rid=f"c{i}")
            for engine in (gpu, plain):
                events = await collect(
                    engine.generate(f"g{i}", prompt, Sampling(max_tokens=24, ignore_eos=True))
                )
                assert (events[0].cached_tokens > 0) == (i == 1)
                _check_near_tie(tiny_dirs[arch], prompt, want, [e.token_id for e in events])
        # Alone in its step, the suffix's rows shared one page table (its K/V gathered once).
        assert gpu.stats().extra["static_prefill_chunks"] == 1
        assert gpu.stats().extra["static_shared_chunks"] == 1
        # The third prompt arrives while another request decodes: one step of a decode row and 11 rows.
        stream = gpu.generate("long", prompt_of(cpu, 30, seed=1), Sampling(max_tokens=24, ignore_eos=True))
        await anext(stream)
        late = asyncio.create_task(greedy_tokens(gpu, prompts[2], 24, rid="late"))
        await collect(stream)
        _check_near_tie(
            tiny_dirs[arch], prompts[2], await greedy_tokens(cpu, prompts[2], 24, rid="c2"), await late
        )
        assert gpu.stats().extra["static_prefill_chunks"] == 2
        assert plain.stats().extra["static_prefill_chunks"] == 0
    finally:
        await cpu.close()
        await gpu.close()
        await plain.close()


@pytest.mark.parametrize("arch", ARCHS)
async def test_a_compiled_static_step_follows_the_eager_one(arch: str, tiny_dirs: dict[str, Path]) -> None:
    """`compile_static`: decode rows and a prefix hit's suffix replay graphs of torch.compile's fused
    kernels, and the tokens follow the float32 CPU reference as the eager step's do."""
    cpu = ReferenceEngine.load(tiny_dirs[arch], num_pages=64)
    gpu = ReferenceEngine.load(
        tiny_dirs[arch], device="cuda", num_pages=64, max_running=8, compile_static=True
    )
    try:
        assert gpu.capture_decode_graphs() > 0
        shared = prompt_of(cpu, 48, seed=7)
        # The second prompt's 7-token suffix fits the largest row bucket (max_running 8): a static step.
        prompts = [shared + prompt_of(cpu, n, seed=n) for n in (5, 7)]
        for i, prompt in enumerate(prompts):
            want = await greedy_tokens(cpu, prompt, 24, rid=f"c{i}")
            events = await collect(gpu.generate(f"g{i}", prompt, Sampling(max_tokens=24, ignore_eos=True)))
            assert (events[0].cached_tokens > 0) == (i == 1)
            _check_near_tie(tiny_dirs[arch], prompt, want, [e.token_id for e in events])
        assert gpu.stats().extra["static_shared_chunks"] == 1  # the suffix ran as the compiled rows
        got = await _run_all(gpu, prompts, 16)  # together: decode rows of a two-row bucket
        want = await _run_all(cpu, prompts, 16)
        for prompt, w, g in zip(prompts, want, got, strict=True):
            _check_near_tie(tiny_dirs[arch], prompt, w, g)
    finally:
        await cpu.close()
        await gpu.close()
