"""CUDA runs: float16 greedy tokens follow a float32 CPU reference on the tiny checkpoints.

Float16 rounding may flip an argmax where the float32 model itself hesitates, so a divergence is accepted
only at a step where the reference's top two logits are within `_NEAR_TIE`; anywhere else it is a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xavier_core.engine.reference import ReferenceEngine

from .conftest import ARCHS, greedy_tokens, prompt_of
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
            if got != want:
                k = next(j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
                logits = _our_logits(tiny_dirs[arch], torch.tensor(prompt + want[:k]))[-1]
                top2 = torch.topk(logits, 2).values
                assert float(top2[0] - top2[1]) < _NEAR_TIE, f"{arch}: diverged at {k} without a near tie"
    finally:
        await cpu.close()
        await gpu.close()
