"""Reference engine throughput: prefill and decode tokens/s at several concurrencies.

    python benchmarks/engine.py --make-tiny-shape tiny --device cpu
    python benchmarks/engine.py --make-tiny-shape qwen2.5-0.5b --device cuda
    python benchmarks/engine.py --model /path/to/checkpoint --device cuda
    python benchmarks/engine.py --make-tiny-shape qwen2.5-0.5b --device cuda --no-cuda-graphs

Prefill: `c` prefill-only requests of `--prompt-len` distinct random tokens, submitted together; prompt
tokens / wall time. A short decode at each concurrency warms up first. Decode: `c` requests generating
`--output-len` tokens each (EOS ignored); tokens produced after the last request's first token / time from
then to the end. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from xavier_core.engine.api import Sampling
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.tiny import SHAPES, make_tiny


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


async def bench_prefill(engine: ReferenceEngine, prompts: list[list[int]], tag: str) -> dict[str, float]:
    start = time.perf_counter()
    results = await asyncio.gather(
        *(engine.prefill(f"{tag}-{i}", p, Sampling(max_tokens=1)) for i, p in enumerate(prompts))
    )
    wall = time.perf_counter() - start
    for i in range(len(results)):
        engine.release_pages(f"{tag}-{i}")
    tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": tokens, "seconds": round(wall, 4), "tokens_per_s": round(tokens / wall, 1)}


async def bench_decode(
    engine: ReferenceEngine, prompts: list[list[int]], output_len: int, tag: str
) -> dict[str, float]:
    sampling = Sampling(max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> list[float]:
        stamps = []
        async for _ in engine.generate(f"{tag}-{i}", prompt, sampling, cache_salt=tag):
            stamps.append(time.perf_counter())
        return stamps

    all_stamps = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    t0 = max(s[0] for s in all_stamps)
    end = max(s[-1] for s in all_stamps)
    after = sum(1 for s in all_stamps for t in s if t > t0)
    ttft = sum(s[0] - start for s in all_stamps) / len(all_stamps)
    return {
        "output_tokens": sum(len(s) for s in all_stamps),
        "seconds": round(end - start, 4),
        "tokens_per_s": round(after / max(end - t0, 1e-9), 1),
        "mean_ttft_s": round(ttft, 4),
    }


async def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    max_c = max(args.concurrency)
    engine = ReferenceEngine.load(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        num_pages=args.num_pages,
        max_running=max(max_c, 1),
        chunk_tokens=args.chunk_tokens,
        cuda_graphs=not args.no_cuda_graphs,
    )
    vocab = min(engine.tokenizer.vocab_size, engine.config.vocab_size)
    try:
        await bench_decode(engine, _prompts(2, 16, vocab, 99), 4, "warmup")
        # A short decode at each concurrency, as a server captures its decode graphs before taking
        # traffic: the measured runs then replay graphs instead of capturing them.
        for c in args.concurrency:
            await bench_decode(engine, _prompts(c, args.prompt_len, vocab, 77 + c), 4, f"warmup{c}")
        out: dict[str, Any] = {
            "device": engine.device,
            "dtype": engine.dtype_name,
            "model": str(model_dir),
            "layers": engine.num_layers,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "chunk_tokens": args.chunk_tokens,
            "cuda_graphs": args.device.startswith("cuda") and not args.no_cuda_graphs,
            "results": [],
        }
        for c in args.concurrency:
            prompts = _prompts(c, args.prompt_len, vocab, args.seed + c)
            prefill = await bench_prefill(engine, prompts, f"p{c}")
            decode_prompts = _prompts(c, args.prompt_len, vocab, args.seed + 1000 + c)
            decode = await bench_decode(engine, decode_prompts, args.output_len, f"d{c}")
            out["results"].append({"concurrency": c, "prefill": prefill, "decode": decode})
        out["stats"] = engine.stats().__dict__
        return out
    finally:
        await engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="checkpoint directory")
    src.add_argument("--make-tiny-shape", choices=["tiny", "qwen2.5-0.5b"], default="tiny")
    p.add_argument("--arch", choices=["qwen2", "qwen3", "llama"], default="qwen2")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=4096)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cuda-graphs", action="store_true", help="run CUDA decode steps eagerly")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            shape = SHAPES.get(args.make_tiny_shape, {})
            dtype = "float16" if shape else "float32"
            model_dir = make_tiny(Path(tmp) / "model", args.arch, dtype=dtype, **shape)  # type: ignore[arg-type]
        print(json.dumps(asyncio.run(run(args, model_dir)), indent=2))


if __name__ == "__main__":
    main()
