"""The static-shape decode path (the one CUDA graphs capture), run eagerly on the CPU in float32.

It must give the general forward's greedy tokens and logprobs, with padded rows and padded page tables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from xavier_core.engine.api import InvalidRequestError, Sampling
from xavier_core.engine.decode_graph import DecodeRunner, bucket
from xavier_core.engine.reference import ReferenceEngine

from .conftest import ARCHS, collect, prompt_of

Factory = Callable[..., ReferenceEngine]


def test_bucket_is_the_next_power_of_two() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 32, 33)] == [1, 2, 4, 8, 32, 64]
    assert bucket(1, floor=4) == 4 and bucket(9, floor=4) == 16


def test_graphs_refused_on_cpu(engine_factory: Factory) -> None:
    engine = engine_factory("llama")
    with pytest.raises(InvalidRequestError, match="CUDA"):
        DecodeRunner(engine.model, engine.kv_pool, use_graphs=True, max_rows=8)


def test_a_compiled_step_is_refused_off_cuda(tiny_dirs: dict[str, Path]) -> None:
    """Only CUDA runs the static step, so compiling it anywhere else is a mistake the caller hears of: the
    engine names its argument, the service its config key."""
    from xavier_services.peer.config import EngineSection, PeerServiceConfig
    from xavier_services.peer.host import load_engine

    from xavier_core.runtime.errors import InvalidArgument

    with pytest.raises(InvalidRequestError, match="compile_static needs a CUDA device"):
        ReferenceEngine.load(tiny_dirs["llama"], num_pages=32, compile_static=True)
    config = PeerServiceConfig(engine=EngineSection(model=tiny_dirs["llama"], num_pages=32, compile=True))
    with pytest.raises(InvalidArgument, match=r"engine\.compile needs a CUDA device") as err:
        load_engine(config)
    assert err.value.metadata["key"] == "engine.compile"


async def _run_all(
    engine: ReferenceEngine, prompts: list[list[int]], n: int
) -> list[list[tuple[int, float]]]:
    sampling = Sampling(max_tokens=n, ignore_eos=True)
    streams = [collect(engine.generate(f"r{i}", p, sampling)) for i, p in enumerate(prompts)]
    return [[(e.token_id, e.logprob) for e in events] for events in await asyncio.gather(*streams)]


@pytest.mark.parametrize("arch", ARCHS)
async def test_static_decode_matches_general_forward(arch: str, engine_factory: Factory) -> None:
    general = engine_factory(arch, chunk_tokens=64)
    static = engine_factory(arch, chunk_tokens=64)
    decoder = DecodeRunner(static.model, static.kv_pool, use_graphs=False, max_rows=8)
    static._loop.decoder = decoder
    # Five rows pad to a bucket of eight; lengths cross page-bucket boundaries (4, 8 pages of 16).
    prompts = [prompt_of(general, n, seed=i) for i, n in enumerate((3, 17, 60, 90, 33))]
    want = await _run_all(general, prompts, 24)
    got = await _run_all(static, prompts, 24)
    assert decoder.steps > 10
    for w, g in zip(want, got, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-4)
