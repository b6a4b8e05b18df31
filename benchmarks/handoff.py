"""P/D KV handoff: time and GB/s against prompt length, by transport: NIXL with coalesced runs, NIXL with
one descriptor per page, staged NIXL (`staged`: the source gathers the pages into its registered slab,
the reader READs whole chunks through a ring of `--depth` chunks and scatters each; its time is the
source's gather plus the reader's READs and scatters, the gather also reported alone), and
(`--device cuda`) CUDA IPC with the fused page-copy kernel (`cuda_ipc`: the reader maps the source
process's pool once, then each handoff is one launch, timed from issue until its CUDA event completes).
Choose with `--modes`; `vs_coalesced` gives each mode's speed-up over today's coalesced NIXL in the
same run.

Two processes: a source (prefill-like) that publishes pages through `KvSender` and keeps polling, and a
reader (decode-like, this process) that times `KvReceiver.start()` → SUCCESS. Both modes run in the same
session, in alternating order, and each point is the median of `--reps` repetitions. DRAM on CPU; VRAM
with `--device cuda` (source on cuda:0, reader on cuda:1 when there are two GPUs). Prints JSON, writes a
PNG. Example: `python benchmarks/handoff.py --reps 7 --out-dir /tmp/handoff`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xavier_core.transfer import (
    KvBuffer,
    KvManager,
    KvPoll,
    KvReceiver,
    KvSender,
    NixlAgent,
    SourceInfo,
    peer_key,
)
from xavier_core.transfer.common.runs import coalesce
from xavier_core.transfer.common.slab_layout import SlabLayout
from xavier_core.transfer.staged.read import PIPELINE_DEPTH, StagedRead
from xavier_core.transfer.staged.slab import Slab, View

MODES = ("coalesced", "per_page", "staged")
ALL_MODES = ("coalesced", "per_page", "staged", "cuda_ipc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--tokens", default="256,512,1024,2048,4096,8192")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--mean-run", type=float, default=0.0, help="mean pages per contiguous run; 0: one run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {ALL_MODES}")
    p.add_argument("--chunk-mib", type=float, default=4.0, help="staged: slab chunk size")
    p.add_argument("--depth", type=int, default=PIPELINE_DEPTH, help="staged: reader ring chunks")
    return p.parse_args(argv)


def make_pool(args: argparse.Namespace, pages: int, device: str, seed: int | None) -> list[torch.Tensor]:
    """Per layer a K and a V buffer [pages*page_size, kv_heads, head_dim]; random bits or zeros."""
    shape = (pages * args.page_size, args.kv_heads, args.head_dim)
    dtype = getattr(torch, args.dtype)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * args.layers)]
    gen = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape).to(device)
        for _ in range(2 * args.layers)
    ]


def kv_buffers(pool: list[torch.Tensor], pages: int) -> list[KvBuffer]:
    out = []
    for t in pool:
        nbytes = t.numel() * t.element_size()
        dev = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index or 0}"
        out.append(KvBuffer(t.data_ptr(), nbytes, nbytes // pages, dev))
    return out


def page_list(n: int, pool_pages: int, mean_run: float, rng: np.random.Generator) -> list[int]:
    """n page ids of a pool: one run, or runs of geometric length (mean `mean_run`) in random order."""
    if mean_run <= 0:
        return list(range(n))
    cuts, pos = [], 0
    while pos < pool_pages:
        length = int(rng.geometric(1.0 / mean_run))
        cuts.append(range(pos, min(pos + length, pool_pages)))
        pos += length
    order = rng.permutation(len(cuts))
    ids = [p for i in order for p in cuts[i]]
    return ids[:n]


def devices(args: argparse.Namespace) -> tuple[str, str]:
    if args.device == "cpu":
        return "cpu", "cpu"
    return "cuda:0", ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")


def source_main(conn: Connection, args: argparse.Namespace, pool_pages: int) -> None:
    device = devices(args)[0]
    if device != "cpu":
        torch.cuda.set_device(device)
    pool = make_pool(args, pool_pages, device, args.seed)
    bufs = kv_buffers(pool, pool_pages)
    agent = NixlAgent(f"handoff-src-{os.getpid()}", bufs)
    slab = Slab(slab_layout(args, bufs, pool_pages), device)
    agent.register_extra(slab.buffer)
    pool_t = View.of(bufs)
    staged: dict[str, list[int]] = {}
    manager = KvManager(agent, bufs, args.page_size)
    senders: dict[str, KvSender] = {}
    conn.send("ready")
    while True:
        # Without a progress thread the source must keep polling for the reader's READ to complete.
        manager.progress()
        if not conn.poll(0):
            continue
        cmd, *rest = conn.recv()
        if cmd == "stop":
            break
        room, pages = rest
        if cmd == "export":
            from xavier_core.transfer.cuda.ipc import export_pool

            conn.send(export_pool(bufs).to_bytes())
        elif cmd in ("publish", "publish_staged"):
            s = senders[room] = KvSender(manager, room)
            s.init(len(pages))
            info = s.send(pages)
            gather_s = 0.0
            if cmd == "publish_staged":
                chunks = staged[room] = slab.alloc(slab.layout.chunks_for(len(pages))) or []
                t0 = time.perf_counter()
                slab.gather(pool_t, np.asarray(pages, dtype=np.int64), chunks)
                gather_s = time.perf_counter() - t0
                info = dataclasses.replace(info, staging_runs=tuple(coalesce(chunks)), slab=slab.buffer)
            conn.send((info, gather_s))  # a SourceInfo pickles
        elif cmd == "clear":
            senders.pop(room).clear()
            slab.free(staged.pop(room, []))
            conn.send("ok")
    agent.close()


def handoff(manager: KvManager, info: SourceInfo, room: str, dest: list[int], mode: str) -> tuple[float, int]:
    rx = KvReceiver(manager, room)
    rx.init()
    rx.send_metadata(dest)
    t0 = time.perf_counter()
    rx.start(info, peer_key("handoff-src", 1), mode=mode)  # type: ignore[arg-type]
    while (state := rx.poll()) == KvPoll.TRANSFERRING:
        pass
    elapsed = time.perf_counter() - t0
    if state != KvPoll.SUCCESS:
        raise RuntimeError(f"handoff failed: {rx.error}")
    descs = rx._xfer.descriptor_count if rx._xfer is not None else 0
    rx.clear()
    return elapsed, descs


def slab_layout(args: argparse.Namespace, bufs: list[KvBuffer], pool_pages: int) -> SlabLayout:
    """The source's slab holds one room of the largest size; the reader's, its ring."""
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    layout = SlabLayout.plan(bufs, chunk_bytes, chunk_bytes)
    return SlabLayout(layout.sizes, layout.chunk_pages, layout.chunks_for(pool_pages))


def handoff_staged(
    agent: NixlAgent, slab: Slab, pool_t: View, info: SourceInfo, room: str, dest: list[int]
) -> tuple[float, int]:
    """READs of the source's chunks into a ring of `slab`'s chunks, each scattered as it lands."""
    remote, remote_layout = info.staging_slab()
    peer = peer_key("handoff-src", 1)
    agent.add_peer(peer, info.metadata)
    chunks = info.staging_chunks()
    ring = slab.alloc(min(slab.layout.num_chunks, chunks.size))
    if ring is None:
        raise RuntimeError("the reader's slab is busy")
    dst = np.asarray(dest, dtype=np.int64)
    read = StagedRead(
        agent, slab, pool_t, peer, remote, remote_layout, chunks, dst, ring, room, info.token, 30
    )
    t0 = time.perf_counter()
    read.start()
    while (state := read.step()) == KvPoll.TRANSFERRING:
        pass
    elapsed = time.perf_counter() - t0
    if state != KvPoll.SUCCESS:
        raise RuntimeError(f"staged handoff failed: {read.error}")
    return elapsed, int(chunks.size)


def handoff_ipc(view: Any, local: Any, src: list[int], dst: list[int]) -> tuple[float, int]:
    """One fused copy from the mapped source pool, timed until its CUDA event completes."""
    from xavier_core.transfer.cuda.copy import copy_pages

    t0 = time.perf_counter()
    h = copy_pages(view, local, src, dst, device=local.device)
    while not h.is_done():
        pass
    return time.perf_counter() - t0, h.launches


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = tuple(m for m in args.modes.split(",") if m)
    if set(modes) - set(ALL_MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(ALL_MODES))}")
    tokens = [int(t) for t in args.tokens.split(",")]
    pool_pages = max(-(-t // args.page_size) for t in tokens)
    src_dev, dst_dev = devices(args)
    if dst_dev != "cpu":
        torch.cuda.set_device(dst_dev)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=source_main, args=(child, args, pool_pages), daemon=True)
    proc.start()
    if not conn.poll(120):
        raise TimeoutError("source process did not start")
    conn.recv()
    expected = make_pool(args, pool_pages, dst_dev, args.seed)
    pool = make_pool(args, pool_pages, dst_dev, None)
    bufs = kv_buffers(pool, pool_pages)
    agent = NixlAgent(f"handoff-dst-{os.getpid()}", bufs)
    ring_layout = slab_layout(args, bufs, pool_pages)
    slab = Slab(SlabLayout(ring_layout.sizes, ring_layout.chunk_pages, args.depth), dst_dev)
    agent.register_extra(slab.buffer)
    pool_t = View.of(bufs)
    manager = KvManager(agent, bufs, args.page_size)
    view = local = None
    if "cuda_ipc" in modes:
        from xavier_core.transfer.cuda.copy_plan import PoolView
        from xavier_core.transfer.cuda.ipc import IpcImporter

        conn.send(("export", "", []))
        local = PoolView.from_buffers(bufs)
        importer = IpcImporter(local.device)
        view = importer.open("handoff-src", 1, conn.recv())
    rng = np.random.default_rng(args.seed)
    samples: dict[tuple[int, str], list[float]] = {}
    gathers: dict[int, list[float]] = {}
    descs: dict[tuple[int, str], int] = {}
    seq = 0
    try:
        for rep in range(args.reps + 1):  # rep 0 warms up connections and caches, and verifies bytes
            for n_tok in tokens:
                n = -(-n_tok // args.page_size)
                src = page_list(n, pool_pages, args.mean_run, rng)
                dst = page_list(n, pool_pages, args.mean_run, rng)
                for mode in modes if (rep + n_tok // 256) % 2 == 0 else modes[::-1]:
                    seq += 1
                    room = f"r{seq}"
                    conn.send(("publish_staged" if mode == "staged" else "publish", room, src))
                    info, gather_s = conn.recv()
                    if rep == 0:
                        for t in pool:
                            t.zero_()
                    if mode == "cuda_ipc":
                        elapsed, descs[(n_tok, mode)] = handoff_ipc(view, local, src, dst)
                    elif mode == "staged":
                        elapsed, descs[(n_tok, mode)] = handoff_staged(agent, slab, pool_t, info, room, dst)
                        elapsed += gather_s
                        if rep:
                            gathers.setdefault(n_tok, []).append(gather_s)
                    else:
                        elapsed, descs[(n_tok, mode)] = handoff(manager, info, room, dst, mode)
                    conn.send(("clear", room, []))
                    conn.recv()
                    if rep == 0:
                        verify(pool, expected, src, dst, args.page_size)
                    else:
                        samples.setdefault((n_tok, mode), []).append(elapsed)
    finally:
        conn.send(("stop",))
        proc.join(10)
        agent.close()
    bytes_per_token = 2 * args.layers * args.kv_heads * args.head_dim * pool[0].element_size()
    rows = []
    for (n_tok, mode), times in sorted(samples.items()):
        nbytes = -(-n_tok // args.page_size) * args.page_size * bytes_per_token
        med = statistics.median(times)
        rows.append(
            {
                "tokens": n_tok,
                "mode": mode,
                "bytes": nbytes,
                "descriptors": descs[(n_tok, mode)],
                "median_ms": round(med * 1e3, 3),
                "min_ms": round(min(times) * 1e3, 3),
                "max_ms": round(max(times) * 1e3, 3),
                "gb_per_s": round(nbytes / med / 1e9, 3),
            }
        )
        if mode == "staged":
            rows[-1]["gather_median_ms"] = round(statistics.median(gathers[n_tok]) * 1e3, 3)
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "tag")}
    config.update(bytes_per_token=bytes_per_token, source_device=src_dev, reader_device=dst_dev)
    return {
        "config": config,
        "results": rows,
        "speedup": speedups(rows),
        "vs_coalesced": speedups(rows, "coalesced"),
    }


def verify(
    pool: list[torch.Tensor], expected: list[torch.Tensor], src: list[int], dst: list[int], ps: int
) -> None:
    s_idx = torch.tensor(src, device=pool[0].device)
    d_idx = torch.tensor(dst, device=pool[0].device)
    for got, want in zip(pool, expected, strict=True):
        g = got.view(-1, ps * got[0].numel()).view(torch.uint8)[d_idx]
        w = want.view(-1, ps * want[0].numel()).view(torch.uint8)[s_idx]
        if not torch.equal(g, w):
            raise RuntimeError("received KV bytes differ from the source's")


def speedups(rows: list[dict[str, Any]], base: str = "per_page") -> dict[str, float]:
    """Per "tokens:mode", how many times faster than `base` at the same size (medians, same run)."""
    by = {(r["tokens"], r["mode"]): r["median_ms"] for r in rows}
    return {f"{t}:{m}": round(by[(t, base)] / by[(t, m)], 2) for t, m in by if m != base and (t, base) in by}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in sorted({r["mode"] for r in report["results"]}):
        rows = [r for r in report["results"] if r["mode"] == mode]
        xs = [r["tokens"] for r in rows]
        ax_t.plot(xs, [r["median_ms"] for r in rows], marker="o", label=mode)
        ax_bw.plot(xs, [r["gb_per_s"] for r in rows], marker="o", label=mode)
    c = report["config"]
    title = (
        f"{c['layers']}L x {c['kv_heads']}h x {c['head_dim']}d {c['dtype']}, page {c['page_size']}, "
        f"{c['source_device']}->{c['reader_device']}, mean run {c['mean_run'] or 'all'}"
    )
    for ax, label in ((ax_t, "handoff time (ms, median)"), (ax_bw, "GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"handoff-{args.device}-{args.dtype}{'-' + args.tag if args.tag else ''}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    json.dump(report, sys.stdout, indent=2)
    print()
    try:
        plot(report, out / f"{stem}.png")
    except ImportError as exc:  # the JSON is the result; the plot needs matplotlib
        print(f"no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
