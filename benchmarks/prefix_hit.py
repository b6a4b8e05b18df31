"""TTFT of a prompt whose prefix is already in the engine's prefix cache, against the same prompt cold.

    python benchmarks/prefix_hit.py [--device cuda] [--shape qwen2.5-0.5b] [--prefix 2000] [--reps 5]

One reference engine in this process (no services, no store): for each rep, a cold prompt of `--prefix`
+ 16 tokens, then another with the same prefix (a local prefix-cache hit that computes 16 tokens). A warm
TTFT close to the cold one means the cached-prefix path itself is slow; `--profile` adds the engine
thread's hottest functions during one warm request (cProfile), `--torch-profile` that request's GPU kernels
(torch.profiler: where a warm suffix's compute goes on a GPU). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from xavier_core.engine import engine_loop
from xavier_core.engine.api import Sampling
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.tiny import SHAPES, make_tiny, shape_sizes

_PROFILE = cProfile.Profile()
_PROFILING = [False]


def _profiled_step(original: Any) -> Any:
    def step(self: Any, plan: Any) -> Any:
        if _PROFILING[0]:
            _PROFILE.enable()
        try:
            return original(self, plan)
        finally:
            if _PROFILING[0]:
                _PROFILE.disable()

    return step


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 509 for i in range(n)]


async def ttft_ms(engine: ReferenceEngine, rid: str, tokens: list[int]) -> float:
    t = time.perf_counter()
    async for _ in engine.generate(rid, tokens, Sampling(max_tokens=1, ignore_eos=True)):
        pass
    return 1e3 * (time.perf_counter() - t)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = shape_sizes(args.shape, args.layers)
    dtype = "float16" if args.device != "cpu" else "float32"
    model = make_tiny(Path(tempfile.mkdtemp()) / "m", "qwen2", dtype=dtype, **sizes)
    engine = ReferenceEngine.load(model, device=args.device, num_pages=max(600, 4 * args.prefix // 16))
    try:
        engine.capture_decode_graphs()
        await ttft_ms(engine, "warm-up", prompt(99, 64))
        cold, warm = [], []
        for rep in range(args.reps):
            shared = prompt(1000 + rep, args.prefix)
            cold.append(await ttft_ms(engine, f"cold-{rep}", shared + prompt(5000 + rep, 16)))
            warm.append(await ttft_ms(engine, f"warm-{rep}", shared + prompt(6000 + rep, 16)))
        out: dict[str, Any] = {
            "benchmark": "prefix_hit",
            "device": args.device,
            "shape": args.shape,
            "prefix_tokens": args.prefix,
            "cold_ms": statistics.median(cold),
            "warm_local_ms": statistics.median(warm),
            "cold_ms_all": cold,
            "warm_local_ms_all": warm,
            # Prefill chunks run as decode rows (static shapes, CUDA graphs): one per warm prompt on CUDA.
            "static_prefill_chunks": engine.stats().extra["static_prefill_chunks"],
            "static_shared_chunks": engine.stats().extra["static_shared_chunks"],
        }
        if args.profile:
            shared = prompt(77, args.prefix)
            await ttft_ms(engine, "profile-cold", shared + prompt(1, 16))
            _PROFILING[0] = True
            out["profiled_warm_ms"] = await ttft_ms(engine, "profile-warm", shared + prompt(2, 16))
            _PROFILING[0] = False
            text = io.StringIO()
            pstats.Stats(_PROFILE, stream=text).sort_stats("tottime").print_stats(15)
            out["engine_thread_profile"] = text.getvalue().splitlines()
        if args.torch_profile:
            out["torch_profile"] = await torch_profile(engine, args.prefix)
        return out
    finally:
        await engine.close()


async def torch_profile(engine: ReferenceEngine, prefix: int) -> dict[str, Any]:
    """One warm request under torch.profiler: wall time, GPU busy time, kernel launches, the top kernels (the
    engine's thread runs the operators, so only the GPU side is recorded)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    shared = prompt(78, prefix)
    await ttft_ms(engine, "torch-profile-cold", shared + prompt(3, 16))
    await ttft_ms(engine, "torch-profile-warm-0", shared + prompt(4, 16))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        warm_ms = await ttft_ms(engine, "torch-profile-warm", shared + prompt(5, 16))
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))

    kernels = [e for e in events if device_us(e) > 0]
    top_gpu = sorted(kernels, key=device_us, reverse=True)[:20]
    return {
        "warm_ms": warm_ms,
        "gpu_busy_ms": sum(device_us(e) for e in kernels) / 1e3,
        "gpu_launches": sum(e.count for e in kernels),
        "top_gpu": [{"name": e.key[:90], "count": e.count, "ms": device_us(e) / 1e3} for e in top_gpu],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    p.add_argument("--layers", type=int, default=0, help="layers instead of the shape's own (28: 7B's depth)")
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--torch-profile", action="store_true")
    args = p.parse_args()
    engine_loop.EngineLoop._step = _profiled_step(engine_loop.EngineLoop._step)  # type: ignore[method-assign]
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
