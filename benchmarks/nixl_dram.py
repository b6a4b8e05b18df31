"""NIXL between two processes' DRAM: which side posts, which op, and the descriptor size, in GB/s.

Two processes (A and B) each register one buffer with a NIXL agent (UCX backend, no progress thread, as
the page store and its clients run) and load each other's metadata. Per descriptor size, each pattern
moves the whole buffer `--reps` times while the other side polls its notifications every 0.5 ms (as the
store's progress thread does), and the median rate is reported:

* `read`: B READs A (a page-store get today: the reader pulls from the arena);
* `write`: B WRITEs into A (a put: the writer pushes into the arena);
* `pushed`: A WRITEs into B (a get the store would push into the reader's registered memory).

UCX picks its transports from the environment (`UCX_TLS`; recorded in the JSON): between processes of
one host it can copy with CMA (`process_vm_readv`/`writev`) or go over TCP.

    python benchmarks/nixl_dram.py --out docs/results/nixl-dram-cpu
    UCX_TLS=tcp,self python benchmarks/nixl_dram.py --out docs/results/nixl-dram-cpu-tcp
    UCX_TLS=^cma UCX_TCP_TX_SEG_SIZE=262144 UCX_TCP_RX_SEG_SIZE=262144 python benchmarks/nixl_dram.py \
        --out docs/results/nixl-dram-cpu-nocma-256k

Prints JSON; writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PATTERNS = {"read": ("B", "READ"), "write": ("B", "WRITE"), "pushed": ("A", "WRITE")}
"""pattern: (the side that posts, its op); the other side polls."""


def _table(base: int, size: int, seg: int) -> np.ndarray:
    return np.array([[base + i * seg, seg, 0] for i in range(size // seg)], dtype=np.uint64)


def side(name: str, size: int, conn: Connection) -> None:
    """One process: registers its buffer, swaps metadata, then posts or polls as told."""
    from xavier_core.transfer.nixl._raw import RawAgent

    agent = RawAgent(f"nixl-dram-{name}-{os.getpid()}", False, "UCX")
    buf = np.full(size, ord(name), dtype=np.uint8)  # touched: no page faults inside a transfer
    agent.register(np.array([[buf.ctypes.data, size, 0]], dtype=np.uint64), "DRAM")
    conn.send((agent.metadata(), buf.ctypes.data))
    meta, remote_base = conn.recv()
    peer = agent.add_remote(meta)
    while (cmd := conn.recv()) != "stop":
        if cmd == "poll":
            while not conn.poll():
                agent.notifs()
                time.sleep(0.0005)
            conn.recv()
            conn.send("polled")
            continue
        op, seg, reps = cmd
        local, remote = _table(buf.ctypes.data, size, seg), _table(remote_base, size, seg)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            handle, state = agent.read(local, "DRAM", remote, "DRAM", peer, b"", op=op)
            while state == "PROC":
                state = agent.check(handle)
            times.append(time.perf_counter() - t)
            agent.release(handle)
            if state != "DONE":
                raise RuntimeError(f"{op} of {size} bytes in {seg}-byte descriptors ended {state}")
        conn.send(size / statistics.median(times) / 1e9)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for pattern in PATTERNS:
        pts = sorted((r["segment_bytes"], r["gbps"]) for r in rows if r["pattern"] == pattern)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=pattern)
    ax.set(xscale="log", xlabel="descriptor bytes", ylabel="GB/s (median)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=int, default=48 << 20, help="buffer size on each side")
    p.add_argument("--segments", default="4096,65536,262144,1048576", help="descriptor sizes")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs the patterns in reverse order")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "nixl-dram")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    pipes = {name: ctx.Pipe() for name in ("A", "B")}
    procs = {name: ctx.Process(target=side, args=(name, args.bytes, pipes[name][1])) for name in pipes}
    for proc in procs.values():
        proc.start()
    conns = {name: pipes[name][0] for name in pipes}
    meta = {name: conns[name].recv() for name in conns}
    conns["A"].send(meta["B"])
    conns["B"].send(meta["A"])
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            order = list(PATTERNS) if rnd % 2 == 0 else list(PATTERNS)[::-1]
            for seg in (int(s) for s in args.segments.split(",")):
                for pattern in order:
                    poster, op = PATTERNS[pattern]
                    other = "A" if poster == "B" else "B"
                    conns[other].send("poll")
                    conns[poster].send((op, seg, args.reps))
                    gbps = conns[poster].recv()
                    conns[other].send("done")
                    conns[other].recv()
                    row = {"round": rnd, "pattern": pattern, "segment_bytes": seg, "gbps": round(gbps, 3)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        for conn in conns.values():
            conn.send("stop")
        for proc in procs.values():
            proc.join(30)
    medians = {
        f"{pattern}/{seg}": statistics.median(
            r["gbps"] for r in rows if r["pattern"] == pattern and r["segment_bytes"] == seg
        )
        for pattern in PATTERNS
        for seg in sorted({r["segment_bytes"] for r in rows})
    }
    ucx_tls = os.environ.get("UCX_TLS", "default")
    segments = os.environ.get("UCX_TCP_TX_SEG_SIZE", "default")  # UCX's TCP segment size (default 8 KiB)
    summary = {"benchmark": "nixl_dram", "ucx_tls": ucx_tls, "ucx_tcp_seg_size": segments,
               "bytes": args.bytes, "reps": args.reps, "rows": rows, "medians_gbps": medians}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"), f"NIXL DRAM to DRAM, two processes (UCX_TLS {ucx_tls})")
    print(json.dumps({"medians_gbps": medians, "out": str(args.out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
