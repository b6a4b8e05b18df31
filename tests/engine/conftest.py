"""Fixtures of the engine tests: tiny checkpoints written once per session, fresh engines per test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from xavier_core.engine.api import Sampling, TokenEvent
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.tiny import make_tiny

ARCHS = ("qwen2", "qwen3", "llama")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per architecture; qwen2 ties its embeddings, the others do not."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(root / arch, arch, tie_word_embeddings=arch == "qwen2") for arch in ARCHS}


@pytest.fixture
def engine_factory(tiny_dirs: dict[str, Path]) -> Iterator[Callable[..., ReferenceEngine]]:
    """Builds engines on the tiny checkpoints and closes them after the test."""
    made: list[ReferenceEngine] = []

    def make(arch: str = "llama", **kwargs: Any) -> ReferenceEngine:
        kwargs.setdefault("num_pages", 256)
        engine = ReferenceEngine.load(tiny_dirs[arch], **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        asyncio.run(engine.close())


async def collect(stream: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    """Drains a token stream."""
    return [event async for event in stream]


async def pd_events(
    prefill: ReferenceEngine, decode: ReferenceEngine, rid: str, prompt: list[int], s: Sampling
) -> list[TokenEvent]:
    """A prefill on `prefill` continued by a decode on `decode`: the prompt's pages copied across, the
    prefill's released, the decode's events."""
    res = await prefill.prefill(rid, prompt, s)
    decode.write_pages(decode.reserve_pages(rid, len(prompt)), prefill.read_pages(res.page_ids))
    prefill.release_pages(rid)
    return await collect(decode.decode_from_pages(rid, prompt, res.first_token, res.first_logprob, s))


async def greedy_tokens(
    engine: ReferenceEngine, prompt: list[int], n: int = 32, rid: str = "r", salt: str = ""
) -> list[int]:
    """Greedy continuation of `prompt` of exactly `n` tokens."""
    sampling = Sampling(max_tokens=n, ignore_eos=True)
    events = await collect(engine.generate(rid, prompt, sampling, cache_salt=salt))
    return [e.token_id for e in events]


def prompt_of(engine: ReferenceEngine, length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of `length` ids drawn from real text."""
    text = "The quick brown fox jumps over the lazy dog. Once upon a time there was a small village. "
    ids = engine.tokenizer.encode(text * (1 + length // 10), add_special_tokens=False)
    ids = ids[seed % 7 :] + ids[: seed % 7]
    return ids[:length]
