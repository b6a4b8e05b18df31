"""Null compute: the real engine around a near-zero-cost model with deterministic K/V and logits."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from xavier.v1 import types_pb2
from xavier_services.peer.config import EngineSection, PeerServiceConfig
from xavier_services.peer.host import PeerHost, load_engine

from xavier_core.engine.api import FinishReason, InvalidRequestError, Sampling
from xavier_core.engine.null_model import null_next_token
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.runtime.config import ConfigError, load_config

from .conftest import collect, greedy_tokens, pd_events, prompt_of

Factory = Callable[..., ReferenceEngine]


def _rule_chain(last: int, n: int, vocab: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        last = null_next_token(last, vocab)
        out.append(last)
    return out


def _expected_pages(engine: ReferenceEngine, prompt: list[int], num_pages: int) -> bytes:
    """What `read_pages` returns for the prompt's pages in a fresh null engine (unused slots stay 0)."""
    ps, cfg = engine.page_size, engine.config
    slots = num_pages * ps
    ids = torch.tensor(prompt + [0] * (slots - len(prompt)), dtype=torch.long)
    pos = torch.arange(slots)
    used = (pos < len(prompt)).view(-1, 1, 1)
    parts = []
    for b in range(2 * cfg.num_layers):
        v = ((ids * 31 + pos + 17 * b) % 251).float() / 251
        v = v.to(engine.kv_pool.dtype).view(-1, 1, 1).expand(slots, cfg.num_kv_heads, cfg.head_dim)
        parts.append(torch.where(used, v, torch.zeros_like(v)).contiguous().view(-1))
    return torch.cat(parts).view(torch.uint8).numpy().tobytes()


async def test_greedy_follows_the_rule_and_is_deterministic(engine_factory: Factory) -> None:
    engine = engine_factory("llama", compute="null")
    assert engine.compute == "null" and engine.capture_decode_graphs() == 0
    vocab = engine.config.vocab_size
    prompt = prompt_of(engine, 37)
    first = await greedy_tokens(engine, prompt, 24, rid="a")
    assert first == _rule_chain(prompt[-1], 24, vocab)
    assert await greedy_tokens(engine, prompt, 24, rid="b") == first
    other = engine_factory("qwen3", compute="null")
    assert await greedy_tokens(other, prompt, 24) == _rule_chain(prompt[-1], 24, other.config.vocab_size)
    s = engine.stats()
    assert s.prompt_tokens_cached > 0  # the prefix cache stays real
    assert s.extra["decode_graphs"] == 0 and s.pages_pinned == 0


async def test_temperature_sampling_still_works(engine_factory: Factory) -> None:
    engine = engine_factory("qwen2", compute="null")
    sampling = Sampling(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    prompt = prompt_of(engine, 10)
    runs = [[e.token_id for e in await collect(engine.generate(f"r{i}", prompt, sampling))] for i in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20
    assert all(0 <= t < engine.config.vocab_size for t in runs[0])


async def test_null_engines_write_identical_checkable_pages(engine_factory: Factory) -> None:
    a = engine_factory("llama", compute="null", chunk_tokens=16)
    b = engine_factory("llama", compute="null")
    prompt = prompt_of(a, 45)
    ra = await a.prefill("x", prompt, Sampling())
    rb = await b.prefill("x", prompt, Sampling())
    assert ra.first_token == rb.first_token == null_next_token(prompt[-1], a.config.vocab_size)
    assert len(ra.page_ids) == 3
    assert a.read_pages(ra.page_ids) == b.read_pages(rb.page_ids) == _expected_pages(a, prompt, 3)
    rc = await a.prefill("y", prompt_of(a, 45, seed=3), Sampling())
    assert a.read_pages(rc.page_ids) != a.read_pages(ra.page_ids)
    for engine, rid in ((a, "x"), (a, "y"), (b, "x")):
        engine.release_pages(rid)


async def test_null_prefill_then_decode_from_pages(engine_factory: Factory) -> None:
    p = engine_factory("qwen2", compute="null")
    d = engine_factory("qwen2", compute="null")
    prompt = prompt_of(p, 40)
    sampling = Sampling(max_tokens=12, ignore_eos=True)
    events = await pd_events(p, d, "req", prompt, sampling)
    assert [e.token_id for e in events] == _rule_chain(prompt[-1], 12, d.config.vocab_size)
    assert events[-1].finish is FinishReason.LENGTH


async def test_null_needs_no_weights(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dirs["llama"], bare, ignore=shutil.ignore_patterns("*.safetensors"))
    engine = ReferenceEngine.load(bare, num_pages=32, compute="null")
    try:
        assert await greedy_tokens(engine, [5, 6, 7], 3) == _rule_chain(7, 3, engine.config.vocab_size)
    finally:
        await engine.close()


def test_bogus_compute_is_rejected(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequestError, match="compute must be one of model, null; got 'bogus'"):
        ReferenceEngine.load(tiny_dirs["llama"], num_pages=32, compute="bogus")


def test_prefix_fingerprint_differs_between_model_and_null(engine_factory: Factory) -> None:
    real = engine_factory("llama")
    null = engine_factory("llama", compute="null")
    assert real.compute == "model"
    assert real.layout_fingerprint != null.layout_fingerprint
    assert engine_factory("llama", compute="null").layout_fingerprint == null.layout_fingerprint


def test_config_compute_key(tmp_path: Path) -> None:
    cfg_file = tmp_path / "peer.toml"
    cfg_file.write_text('[engine]\ncompute = "nope"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(PeerServiceConfig, cfg_file, {}, {})
    [(key, msg, source)] = caught.value.issues
    assert key == "engine.compute" and "'model' or 'null'" in msg and source.startswith("file")
    assert load_config(PeerServiceConfig, None, {}, {}).engine.compute == "model"
    # `xavier up --compute null` reaches the peers through this variable.
    env = {"XAVIER_ENGINE__COMPUTE": "null"}
    assert load_config(PeerServiceConfig, None, env, {}).engine.compute == "null"


def test_null_and_model_peers_have_different_contracts(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XAVIER_CACHE_DIR", str(tmp_path / "cache"))
    hosts = {}
    for compute in ("model", "null"):
        config = PeerServiceConfig(
            engine=EngineSection(model=tiny_dirs["llama"], num_pages=32, compute=compute)
        )
        engine = load_engine(config)
        try:
            assert engine.compute == compute
            hosts[compute] = PeerHost(config, types_pb2.ROLE_DECODE, engine)
        finally:
            asyncio.run(engine.close())
    assert hosts["model"].layout.engine == "reference"
    assert hosts["null"].layout.engine == "reference-null"
    assert hosts["model"].fingerprint != hosts["null"].fingerprint
