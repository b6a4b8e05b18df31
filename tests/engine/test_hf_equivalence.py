"""The forward pass equals transformers' own implementation of the same checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from xavier_core.engine.checkpoint import load_config, load_weights
from xavier_core.engine.kv_pool import KvPool
from xavier_core.engine.model import CausalLM, ForwardBatch, PrefillSegment

from .conftest import ARCHS, collect, greedy_tokens, prompt_of

transformers = pytest.importorskip("transformers")


def _hf_model(path: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _our_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    cfg = load_config(path)
    model = CausalLM(cfg, load_weights(path, cfg, "cpu", torch.float32), "cpu", torch.float32)
    pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 8, torch.float32, "cpu")
    n = len(ids)
    # Scatter the prompt over non-contiguous pages to exercise the page -> slot mapping.
    slots = torch.cat([torch.arange(16) + 16 * p for p in (5, 2, 7, 0)])[:n]
    batch = ForwardBatch(
        input_ids=ids,
        positions=torch.arange(n),
        out_slots=slots,
        sample_idx=torch.arange(n),
        segments=[PrefillSegment(0, n, 0, slots)],
    )
    return model.forward(batch, pool)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch: str, tiny_dirs: dict[str, Path]) -> None:
    ids = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = _hf_model(tiny_dirs[arch])(ids.unsqueeze(0)).logits[0]
    ours = _our_logits(tiny_dirs[arch], ids)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_matches_transformers(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "llama3"
    shutil.copytree(tiny_dirs["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = _hf_model(path)(ids.unsqueeze(0)).logits[0]
    plain = _our_logits(tiny_dirs["llama"], ids)
    ours = _our_logits(path, ids)
    assert (plain - ours).abs().max() > 1e-3  # the scaling really changes the result
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_continuation_matches_transformers(
    arch: str, tiny_dirs: dict[str, Path], engine_factory
) -> None:  # type: ignore[no-untyped-def]
    engine = engine_factory(arch, chunk_tokens=64)
    prompt = prompt_of(engine, 40)
    ours = await greedy_tokens(engine, prompt, 32)
    hf = _hf_model(tiny_dirs[arch])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(32):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(prompt) :]


async def test_chunked_prefill_matches_single_chunk(engine_factory) -> None:  # type: ignore[no-untyped-def]
    whole = engine_factory("qwen3", chunk_tokens=512)
    chunked = engine_factory("qwen3", chunk_tokens=16)
    prompt = prompt_of(whole, 100)
    a = await collect(whole.generate("a", prompt, _sampling(16)))
    b = await collect(chunked.generate("b", prompt, _sampling(16)))
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True)) < 1e-4
    assert chunked.stats().extra["steps"] > whole.stats().extra["steps"]


def _sampling(n: int):  # type: ignore[no-untyped-def]
    from xavier_core.engine.api import Sampling

    return Sampling(max_tokens=n, ignore_eos=True)
