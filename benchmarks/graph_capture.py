"""What a reference replica's start-up capture costs, with its static-shape step eager and compiled.

    python benchmarks/graph_capture.py [--shape qwen2.5-0.5b] [--modes eager,compiled] [--empty-compile-cache]

Loads a random checkpoint of the shape on CUDA as a replica does (`ReferenceEngine.load` with the engine's
defaults: 64 running requests, the pool that fits) and captures every decode and chunk bucket
(`capture_decode_graphs`), once per mode: `eager` (`engine.compile` off) and `compiled` (on: each layer of
the step is torch.compile's). `--empty-compile-cache` first removes torch's compile caches, as on a machine
that never compiled this model. Prints JSON: seconds to load and to capture, and the graphs captured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.tiny import SHAPES, make_tiny, shape_sizes

MODES = ("eager", "compiled")


def empty_compile_cache() -> list[str]:
    """Removes torch's inductor and Triton caches of this user; returns what was removed."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    gone = []
    for path in (Path(cache_dir()), Path.home() / ".triton", Path.home() / ".cache" / "torch"):
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            gone.append(str(path))
    return gone


def capture(model_dir: Path, compiled: bool) -> dict[str, Any]:
    started = time.perf_counter()
    engine = ReferenceEngine.load(model_dir, device="cuda", compile_static=compiled)
    loaded = time.perf_counter()
    try:
        graphs = engine.capture_decode_graphs()
        return {
            "load_s": round(loaded - started, 2),
            "capture_s": round(time.perf_counter() - loaded, 2),
            "graphs": graphs,
        }
    finally:
        asyncio.run(engine.close())


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("graph_capture.py needs a CUDA device: graphs are captured on CUDA alone")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := sorted(set(modes) - set(MODES)):
        raise SystemExit(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    sizes = shape_sizes(args.shape, args.layers)
    model_dir = make_tiny(Path(tempfile.mkdtemp()) / "m", "qwen2", dtype="float16", seed=args.seed, **sizes)  # type: ignore[arg-type]
    out: dict[str, Any] = {
        "benchmark": "graph_capture",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "layers": sizes["layers"],
        "compile_cache_emptied": empty_compile_cache() if args.empty_compile_cache else [],
    }
    for mode in modes:
        out[mode] = capture(model_dir, compiled=mode == "compiled")
        print(mode, out[mode], flush=True)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=0, help="layers instead of the shape's own")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, in this order: eager, compiled")
    p.add_argument("--empty-compile-cache", action="store_true", help="remove torch's compile caches first")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    report = json.dumps(run(args), indent=2) + "\n"
    print(report, end="")
    if args.out is not None:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
