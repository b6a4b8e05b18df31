"""GPU-to-GPU KV page copy: the fused Triton kernel against torch gather→copy→scatter and per-page copies.

Source pool on cuda:0, destination on cuda:1 (one GPU: both on cuda:0), SGLang MHA layout (per layer a K
and a V buffer [slots, kv_heads, head_dim] fp16). Pages are placed in runs of 1, 4 or one contiguous run,
independently on each side. Times are host wall clock from the call to the end of the copy (what a
transfer waits for), median of `--reps`; `gpu_ms` is the copy stream's own time. Prints JSON, writes a
PNG when matplotlib is there. Example: `python benchmarks/gpu_copy.py --out-dir /tmp/gpu-copy`.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.cuda.copy import copy_pages, copy_stream
from xavier_core.transfer.cuda.copy_plan import PoolView
from xavier_core.transfer.cuda.ipc import IpcImporter, export_pool

# name: (layers, kv_heads, head_dim); 0.5B/7B as Qwen2.5 (the handoff benchmark's shapes), 8B as Llama-3.
SHAPES = {"0.5b": (24, 2, 64), "7b": (28, 4, 128), "8b": (32, 8, 128)}
CASES = "0.5b:1024,0.5b:8192,0.5b:32768,7b:8192,7b:32768,8b:8192"
RUNS = (1, 4, 0)
PER_PAGE_MAX_COPIES = 30_000  # the per-page loop costs ~5 µs a copy: skip it beyond this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=CASES, help="shape:tokens,...")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--tag", default="2xh200")
    return p.parse_args(argv)


def placement(n: int, pool_pages: int, run: int, rng: np.random.Generator) -> np.ndarray:
    if run == 0:
        return np.arange(n)
    runs = [np.arange(p, min(p + run, pool_pages)) for p in range(0, pool_pages, run)]
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])[:n]


def pool(shape: str, pages: int, ps: int, device: str, fill: bool) -> list[torch.Tensor]:
    layers, heads, dim = SHAPES[shape]
    make = torch.randn if fill else torch.zeros
    return [make(pages * ps, heads, dim, dtype=torch.float16, device=device) for _ in range(2 * layers)]


def _kv_buffers(bufs: list[torch.Tensor], pages: int) -> list[KvBuffer]:
    n = bufs[0].numel() * 2
    return [KvBuffer(t.data_ptr(), n, n // pages, f"cuda:{t.device.index}") for t in bufs]


def view(bufs: list[torch.Tensor], pages: int) -> PoolView:
    return PoolView.from_buffers(_kv_buffers(bufs, pages))


GATE_CYCLES = 4_000_000  # ~2 ms of GPU sleep: the host enqueues the whole copy before the GPU reaches it


def timed(run_on: int | None, fn: Callable[[], Any], reps: int) -> dict[str, float | None]:
    """Medians over `reps` calls (after one warm-up), in ms: `wall` from the call to the end of the copy
    (what a transfer waits for), `issue` until the call returns, and `gpu`, the copy stream's own time
    measured behind a GPU sleep so host overhead is excluded (Triton paths, `run_on` set)."""
    walls, issues, gpus = [], [], []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        if out is not None:
            out.wait()
        else:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:
            walls.append(t2 - t0)
            issues.append(t1 - t0)
    for i in range(reps + 1 if run_on is not None else 0):
        torch.cuda.synchronize()
        stream = copy_stream(run_on)  # type: ignore[arg-type]
        with torch.cuda.stream(stream):
            torch.cuda._sleep(GATE_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        if i:
            gpus.append(start.elapsed_time(end) / 1e3)
    ms = {"wall": statistics.median(walls), "min": min(walls), "issue": statistics.median(issues)}
    out_ms: dict[str, float | None] = {k: round(v * 1e3, 4) for k, v in ms.items()}
    out_ms["gpu"] = round(statistics.median(gpus) * 1e3, 4) if gpus else None
    return out_ms


def per_page(
    src: list[torch.Tensor], dst: list[torch.Tensor], s: np.ndarray, d: np.ndarray, pages: int
) -> None:
    """One cudaMemcpyPeerAsync per page per buffer, as one descriptor per page would issue."""
    sl, dl = s.tolist(), d.tolist()
    for a, b in zip(src, dst, strict=True):
        av, bv = a.view(pages, -1), b.view(pages, -1)
        for i, j in zip(sl, dl, strict=True):
            bv[j].copy_(av[i], non_blocking=True)


def methods(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    s: np.ndarray,
    d: np.ndarray,
    pages: int,
    devs: tuple[int, int],
) -> dict[str, tuple[int | None, Callable[[], Any]]]:
    """The timed copies of one placement, each with the device whose copy stream runs it (GPU timing)."""
    sv, dv = view(src, pages), view(dst, pages)
    out: dict[str, tuple[int | None, Callable[[], Any]]] = {
        "triton_pull": (devs[1], lambda: copy_pages(sv, dv, s, d)),
        "triton_push": (devs[0], lambda: copy_pages(sv, dv, s, d, device=devs[0])),
        "torch_gather_copy_scatter": (None, lambda: copy_pages(sv, dv, s, d, engine="torch")),
    }
    if s.size * len(src) <= PER_PAGE_MAX_COPIES:
        out["per_page_copies"] = (None, lambda: per_page(src, dst, s, d, pages))
    return out


def bench_case(
    shape: str, tokens: int, args: argparse.Namespace, devs: tuple[int, int]
) -> list[dict[str, Any]]:
    n = -(-tokens // args.page_size)
    pages = 2 * n
    src = pool(shape, pages, args.page_size, f"cuda:{devs[0]}", True)
    dst = pool(shape, pages, args.page_size, f"cuda:{devs[1]}", False)
    nbytes = n * sum(view(src, pages).bytes_per_page)
    rng = np.random.default_rng(args.seed)
    rows = []
    for run in RUNS:
        s, d = placement(n, pages, run, rng), placement(n, pages, run, rng)
        for name, (run_on, fn) in methods(src, dst, s, d, pages, devs).items():
            for t in dst:
                t.zero_()
            reps = 1 if name == "per_page_copies" else args.reps
            ms = timed(run_on, fn, reps)
            rows.append(
                {
                    "shape": shape,
                    "tokens": tokens,
                    "run": run or "contiguous",
                    "method": name,
                    "bytes": nbytes,
                    "median_ms": ms["wall"],
                    "min_ms": ms["min"],
                    "issue_ms": ms["issue"],
                    "gpu_ms": ms["gpu"],
                    "gb_per_s": round(nbytes / ms["wall"] / 1e6, 1),  # type: ignore[operator]
                    "gpu_gb_per_s": round(nbytes / ms["gpu"] / 1e6, 1) if ms["gpu"] else None,
                    "verified": verify(src, dst, s, d, pages),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def verify(
    src: list[torch.Tensor], dst: list[torch.Tensor], s: np.ndarray, d: np.ndarray, pages: int
) -> bool:
    si, di = torch.from_numpy(s).to(src[0].device), torch.from_numpy(d).to(dst[0].device)
    for k in (0, len(src) // 2, len(src) - 1):
        want = src[k].view(pages, -1)[si].to(dst[k].device)
        if not torch.equal(dst[k].view(pages, -1)[di], want):
            return False
    return True


def _exporter(conn: Connection, shape: str, pages: int, ps: int, seed: int) -> None:
    torch.cuda.set_device(0)
    torch.manual_seed(seed)
    src = pool(shape, pages, ps, "cuda:0", True)
    torch.cuda.synchronize()
    conn.send(export_pool(_kv_buffers(src, pages)).to_bytes())
    conn.recv()


def ipc_rows(args: argparse.Namespace, devs: tuple[int, int]) -> list[dict[str, Any]]:
    """The kernel pulling from another process's pool through CUDA IPC (0.5B and 7B, 8,192 tokens)."""
    rows = []
    for shape in ("0.5b", "7b"):
        n = 8192 // args.page_size
        pages = 2 * n
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_exporter, args=(child, shape, pages, args.page_size, args.seed))
        proc.start()
        importer = IpcImporter(devs[1])
        try:
            src = importer.open("bench-exporter", 1, conn.recv())
            torch.manual_seed(args.seed)  # the exporter's bytes, regenerated here to verify the copy
            expected = pool(shape, pages, args.page_size, f"cuda:{devs[1]}", True)
            dst = pool(shape, pages, args.page_size, f"cuda:{devs[1]}", False)
            dv = view(dst, pages)
            rng = np.random.default_rng(args.seed)
            for run in RUNS:
                s, d = placement(n, pages, run, rng), placement(n, pages, run, rng)
                ms = timed(devs[1], lambda s=s, d=d, src=src, dv=dv: copy_pages(src, dv, s, d), args.reps)
                nbytes = n * sum(src.bytes_per_page)
                row = {
                    "shape": shape,
                    "tokens": 8192,
                    "run": run or "contiguous",
                    "method": "triton_pull_ipc",
                }
                row.update(bytes=nbytes, median_ms=ms["wall"], issue_ms=ms["issue"], gpu_ms=ms["gpu"])
                row.update(gb_per_s=round(nbytes / ms["wall"] / 1e6, 1))  # type: ignore[operator]
                row.update(gpu_gb_per_s=round(nbytes / ms["gpu"] / 1e6, 1))  # type: ignore[operator]
                row.update(verified=verify(expected, dst, s, d, pages))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            importer.close()
            conn.send("stop")
            proc.join(30)
    return rows


def warps_sweep(args: argparse.Namespace, devs: tuple[int, int]) -> list[dict[str, Any]]:
    """num_warps against GPU time for 0.5B, 8,192 tokens, runs of 4 (the issue's scattered case)."""
    n, ps = 512, args.page_size
    src = pool("0.5b", 2 * n, ps, f"cuda:{devs[0]}", True)
    dst = pool("0.5b", 2 * n, ps, f"cuda:{devs[1]}", False)
    sv, dv = view(src, 2 * n), view(dst, 2 * n)
    rng = np.random.default_rng(0)
    s, d = placement(n, 2 * n, 4, rng), placement(n, 2 * n, 4, rng)
    out = []
    for w in (1, 2, 4, 8):
        ms = timed(devs[1], lambda w=w: copy_pages(sv, dv, s, d, num_warps=w), args.reps)
        gb = round(n * sum(sv.bytes_per_page) / ms["gpu"] / 1e6, 1)  # type: ignore[operator]
        out.append({"num_warps": w, "wall_ms": ms["wall"], "gpu_ms": ms["gpu"], "gpu_gb_per_s": gb})
    return out


def ptx_vector_ops(cache_dir: str) -> dict[str, int]:
    text = "".join(Path(p).read_text() for p in glob.glob(f"{cache_dir}/**/*.ptx", recursive=True))
    return {
        k: text.count(k)
        for k in (
            "ld.global.cg.v2.b64",
            "ld.global.cg.v4.b32",
            "st.global.cs.v2.b64",
            "st.global.cs.v4.b32",
            "ld.global.cg.b64",
        )
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["shape"], r["tokens"], str(r["run"])) for r in rows}, key=str)
    methods = sorted({r["method"] for r in rows})
    fig, ax = plt.subplots(figsize=(14, 4.8))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        by = {(r["shape"], r["tokens"], str(r["run"])): r["gb_per_s"] for r in rows if r["method"] == m}
        ax.bar([i + k * width for i in range(len(cases))], [by.get(c, 0) for c in cases], width, label=m)
    ax.set_xticks(
        [i + 0.4 for i in range(len(cases))], [f"{s} {t}\nrun {r}" for s, t, r in cases], fontsize=7
    )
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (wall, median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache = os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-gpu-copy-"))
    devs = (0, 1) if torch.cuda.device_count() > 1 else (0, 0)
    rows = []
    for case in args.cases.split(","):
        shape, tokens = case.split(":")
        rows.extend(bench_case(shape, int(tokens), args, devs))
    report = {
        "config": {
            **vars(args),
            "devices": [torch.cuda.get_device_name(d) for d in devs],
            "torch": torch.__version__,
            "peer_access": torch.cuda.can_device_access_peer(*devs) if devs[0] != devs[1] else None,
        },
        "results": rows,
        "ipc_results": ipc_rows(args, devs) if devs[0] != devs[1] else [],
        "num_warps_0.5b_8192_run4": warps_sweep(args, devs),
        "ptx_vector_ops": ptx_vector_ops(cache),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu-copy-{args.tag}.json").write_text(json.dumps(report, indent=2))
    json.dump(report, sys.stdout, indent=2)
    print()
    try:
        plot(rows, out / f"gpu-copy-{args.tag}.png")
    except ImportError as exc:
        print(f"no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
