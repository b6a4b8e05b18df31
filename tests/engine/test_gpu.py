"""CUDA runs: float16 greedy tokens equal a float32 CPU reference on the tiny checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xavier_core.engine.reference import ReferenceEngine

from .conftest import ARCHS, greedy_tokens, prompt_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("arch", ARCHS)
async def test_fp16_cuda_greedy_equals_fp32_cpu(arch: str, tiny_dirs: dict[str, Path]) -> None:
    cpu = ReferenceEngine.load(tiny_dirs[arch], num_pages=64)
    gpu = ReferenceEngine.load(tiny_dirs[arch], device="cuda", num_pages=64)
    try:
        assert gpu.dtype_name == "float16" and gpu.kv_buffers()[0].device.startswith("cuda")
        for i, n in enumerate((9, 40, 70)):
            prompt = prompt_of(cpu, n, seed=i)
            assert await greedy_tokens(gpu, prompt, 32, rid=f"g{i}") == await greedy_tokens(
                cpu, prompt, 32, rid=f"c{i}"
            )
    finally:
        await cpu.close()
        await gpu.close()
