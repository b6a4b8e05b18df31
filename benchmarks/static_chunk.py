"""One prefix hit's suffix as a static-shape step: a page table per row against one shared table.

    python benchmarks/static_chunk.py [--device cuda] [--shape 7b-width] [--layers 28] [--prefix 8000]

The model alone (`CausalLM.decode_static`, no engine, no services): a chunk of `--rows` tokens after
`--prefix` cached keys, run with one page table per row (each row gathers the whole context, as a chunk
beside other requests' rows does) and with one table for all rows (the context gathered once, as a chunk
alone in its step does), in alternating order; eagerly, and on CUDA also replayed from a CUDA graph. The
two must give the same logits. Prints JSON (medians in ms, and the ratio rows / shared).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xavier_core.engine.decode_graph import DecodeRunner
from xavier_core.engine.model import CausalLM, DecodeInputs
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.request import pages_for
from xavier_core.engine.tiny import SHAPES, make_tiny, shape_sizes


def median_ms(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = shape_sizes(args.shape, args.layers)
    cuda = args.device.startswith("cuda")
    dtype = "float16" if cuda else "float32"
    model_dir = make_tiny(Path(tempfile.mkdtemp()) / "m", "qwen2", dtype=dtype, **sizes)  # type: ignore[arg-type]
    ps, n = 16, args.rows
    pages = 1 << (pages_for(args.prefix + n, ps) - 1).bit_length()  # the page bucket
    engine = ReferenceEngine.load(model_dir, device=args.device, num_pages=pages, cuda_graphs=False)
    model, pool = engine.model, engine.kv_pool
    assert isinstance(model, CausalLM)
    gen = torch.Generator(device=pool.device).manual_seed(0)
    for buf in pool.buffers():
        buf.normal_(generator=gen)
    dev = pool.device
    positions = torch.arange(args.prefix, args.prefix + n, device=dev)
    table = torch.arange(pages, device=dev)  # the request's pages are the pool's, in order
    ids = torch.randint(3, 500, (n,), generator=gen, device=dev)

    def inputs(shared: bool) -> DecodeInputs:
        tables = table.unsqueeze(0) if shared else table.expand(n, pages).contiguous()
        return DecodeInputs(ids, positions, positions, positions + 1, tables)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def eager(shared: bool) -> Callable[[], torch.Tensor]:
        return lambda: model.decode_static(inputs(shared), pool)

    captured: list[DecodeInputs] = []

    def graphed(shared: bool, compiled: bool = False) -> Callable[[], torch.Tensor]:
        # Captured as the engine captures its buckets (warm-up off the capturing stream, one graph pool).
        # The replays read the captured inputs' memory, so they are kept as long as the graph: freed,
        # their blocks go to other tensors and the replays index the pool with whatever lands there.
        # Compiled: the step's code is torch.compile's (`CausalLM.compiled_layer`, fused kernels),
        # captured the same way; its warm-up runs compile it.
        runner = DecodeRunner(
            model, pool, use_graphs=True, max_rows=n, compiled="inductor" if compiled else ""
        )
        captured.append(inputs(shared))
        graph, logits = runner._capture(captured[-1])

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    steps: dict[str, Callable[[], torch.Tensor]] = {}
    compile_s: dict[str, float] = {}
    for shared in (False, True):
        name = "shared" if shared else "rows"
        steps[name] = eager(shared)
        if cuda:
            steps[f"{name}_graphed"] = graphed(shared)
            if args.compile:
                t = time.perf_counter()
                steps[f"{name}_compiled"] = graphed(shared, compiled=True)
                compile_s[name] = time.perf_counter() - t
    outs = {name: step().clone() for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for rnd in range(args.rounds):
        for name in steps if rnd % 2 == 0 else reversed(steps):
            times[name].append(median_ms(steps[name], args.reps, sync))
    ms = {name: statistics.median(t) for name, t in times.items()}
    diff = max((outs[name] - outs["rows"]).abs().max().item() for name in outs)
    out: dict[str, Any] = {
        "benchmark": "static_chunk",
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if cuda else "",
        "shape": args.shape,
        "layers": sizes.get("layers", 0),
        "prefix_tokens": args.prefix,
        "rows": n,
        "page_bucket": pages,
        "gathered_mib_per_layer": {  # K and V of every page in the bucket, per table
            "rows": n * pages * 2 * pool.bytes_per_page / 2**20,
            "shared": pages * 2 * pool.bytes_per_page / 2**20,
        },
        "ms": ms,
        "ms_per_round": times,
        "rows_over_shared": {
            k.replace("rows", "", 1) or "eager": ms[k] / ms[k.replace("rows", "shared", 1)]
            for k in ms
            if k.startswith("rows")
        },
        "compile_and_capture_s": compile_s,
        "max_abs_logit_diff": diff,
        "same_argmax": all(bool((o.argmax(-1) == outs["rows"].argmax(-1)).all()) for o in outs.values()),
    }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="7b-width")
    p.add_argument("--layers", type=int, default=0, help="layers instead of the shape's own (28: 7B's depth)")
    p.add_argument("--prefix", type=int, default=8000)
    p.add_argument("--rows", type=int, default=16, help="the chunk's tokens (a row bucket: a power of two)")
    p.add_argument("--reps", type=int, default=5, help="runs per measurement (median)")
    p.add_argument("--rounds", type=int, default=4, help="measurements per variant, in alternating order")
    p.add_argument(
        "--compile",
        action="store_true",
        help="on CUDA also the step compiled by torch.compile (fused kernels), captured in a graph",
    )
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
