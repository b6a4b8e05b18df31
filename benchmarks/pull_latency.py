"""How long a decode's KV pull takes on DRAM, against how often the source polls NIXL.

Two processes, each a `KvPort` over a pool shaped like an engine's (tests/transfer/kvpool.py): the source
publishes 3 pages, the reader pulls them (one NIXL READ; the reader's own poll sees it end, and its "done"
notification goes out), the source waits for that notification and unpublishes. Per source poll
interval (`handoff.source_poll_interval_seconds` in the services) and rep: the pull's wall time and the
time until the source saw "done". A READ that carries a notification (and any READ behind a notification
on the same endpoint) ends only once the source's NIXL worker has progressed (UCX answers it over TCP),
so such a pull waits for the source's next poll; so does any READ where UCX has no one-sided copy
(over TCP alone, without CMA).

    python benchmarks/pull_latency.py --source-poll 0.001,0.002,0.005 --out docs/results/pull-latency-cpu
    python benchmarks/pull_latency.py --source-poll 0.005,0.02 --read-end-agent on,off \
        --out docs/results/pull-latency-cpu-read-end-agent

`--first-pulls N` measures instead a new reader's first pull from the source, with its port connected
ahead (`KvPort.warm`, what a decode's warmer does) and not, N rounds in alternating order:

    python benchmarks/pull_latency.py --first-pulls 8 --out docs/results/pull-latency-cpu-first

`--read-end-agent on,off` measures both ways a reader tells the source its read ended: from a second agent
of its own (on, the default: its READs carry no notification) or on the READ (off).

Prints JSON; writes <out>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xavier.v1 import directory_service_pb2 as dpb  # noqa: E402
from xavier.v1 import types_pb2  # noqa: E402

from tests.transfer.kvpool import PAGE_SIZE, kv_buffers, make_pool, serve_port, spawned  # noqa: E402
from xavier_core.transfer import KvPort, peer_key  # noqa: E402


async def _serve(conn: Connection, name: str, poll: float) -> None:
    pool = make_pool(7)  # held for the life of the port: NIXL reads these addresses
    await serve_port(conn, KvPort(name, kv_buffers(pool), PAGE_SIZE, poll_interval=poll), "host-a")


def _source_main(conn: Connection, name: str, poll: float) -> None:
    asyncio.run(_serve(conn, name, poll))


async def _call(conn: Connection, *cmd: Any) -> Any:
    conn.send(cmd)
    if not await asyncio.to_thread(conn.poll, 30):
        raise TimeoutError(f"the source did not answer {cmd[0]!r}")
    return conn.recv()


async def measure(conn: Connection, reps: int, read_end_agent: bool) -> dict[str, Any]:
    pool = make_pool(None)
    name = f"pull-dst-{os.getpid()}-{time.monotonic_ns()}"
    port = KvPort(name, kv_buffers(pool), PAGE_SIZE, read_end_agent=read_end_agent)
    key = peer_key("pull-src", 1)
    pulls: list[float] = []
    seen: list[float] = []
    try:
        for i in range(reps + 2):  # the first two connect the agents
            room = 1000 + i
            desc, ep = await _call(conn, "publish", room, [i % 60, i % 60 + 1, 63])
            source = dpb.SourceDescriptor.FromString(desc)
            endpoint = types_pb2.TransferEndpoint.FromString(ep)
            await asyncio.sleep(0.02)  # the source's poll is anywhere in its period when the read comes
            t = time.perf_counter()
            await port.pull(room, source, endpoint, key, [5, 6, 7], timeout=10, park_timeout=5)
            pulled = time.perf_counter()
            if await _call(conn, "wait", room) != "done":
                raise RuntimeError(f"room {room}: the source never heard the read end")
            ended = time.perf_counter()
            await _call(conn, "unpublish", room, True)
            if i >= 2:
                pulls.append(1e3 * (pulled - t))
                seen.append(1e3 * (ended - pulled))
    finally:
        await port.close()
    return {
        "pull_ms_p50": statistics.median(pulls),
        "pull_ms_min": min(pulls),
        "pull_ms_max": max(pulls),
        "done_seen_after_ms_p50": statistics.median(seen),
        "pulls_ms": pulls,
    }


async def first_pulls(conn: Connection, rounds: int) -> dict[str, Any]:
    """Each round, two new readers (a port each) make their first pull from the source, one connected
    ahead of it (`KvPort.warm`, then a pause, as a decode's warmer does while nothing waits) and one not,
    in alternating order: what a request's first read from a new peer costs either way."""
    key = peer_key("pull-src", 1)
    got: dict[str, list[float]] = {"cold": [], "warmed": [], "warm": []}
    room = 5000
    for r in range(rounds):
        for warmed in (False, True) if r % 2 == 0 else (True, False):
            room += 1
            pool = make_pool(None)
            port = KvPort(f"first-{os.getpid()}-{room}", kv_buffers(pool), PAGE_SIZE)
            try:
                desc, ep = await _call(conn, "publish", room, [r % 60, r % 60 + 1, 63])
                source = dpb.SourceDescriptor.FromString(desc)
                endpoint = types_pb2.TransferEndpoint.FromString(ep)
                if warmed:
                    t = time.perf_counter()
                    if not await port.warm(key, endpoint):
                        raise RuntimeError("the reader could not warm its port to the source")
                    got["warm"].append(1e3 * (time.perf_counter() - t))
                    await asyncio.sleep(1.5)  # the read-end agent's connection settles meanwhile
                t = time.perf_counter()
                await port.pull(room, source, endpoint, key, [5, 6, 7], timeout=10, park_timeout=5)
                got["warmed" if warmed else "cold"].append(1e3 * (time.perf_counter() - t))
                if await _call(conn, "wait", room) != "done":
                    raise RuntimeError(f"room {room}: the source never heard the read end")
                await _call(conn, "unpublish", room, True)
            finally:
                await port.close()
    out: dict[str, Any] = {f"{k}_ms_p50": statistics.median(v) for k, v in got.items()}
    out.update({f"{k}_ms": v for k, v in got.items()})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source-poll", default="0.001,0.002,0.005", help="source poll intervals (s), in order")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument(
        "--read-end-agent",
        default="on",
        help="the reader's read-end agent, each measured per source poll in alternating order (on,off)",
    )
    p.add_argument(
        "--first-pulls",
        type=int,
        default=0,
        metavar="N",
        help="instead: N rounds of a new reader's first pull, connected ahead (KvPort.warm) and not",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pull-latency-cpu")
    args = p.parse_args()
    if args.first_pulls:
        with spawned(_source_main, "pull-src", 0.005) as conn:
            first = asyncio.run(first_pulls(conn, args.first_pulls))
        result = {"benchmark": "pull_latency", "pages": 3, "first_pulls": first}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in first.items() if k.endswith("_p50")}, indent=1))
        return 0
    modes = [m == "on" for m in args.read_end_agent.split(",")]
    points = []
    for i, poll in enumerate(float(x) for x in args.source_poll.split(",")):
        for apart in modes if i % 2 == 0 else modes[::-1]:
            with spawned(_source_main, f"pull-src-{poll}-{apart}", poll) as conn:
                point = {
                    "source_poll_s": poll,
                    "read_end_agent": apart,
                    **asyncio.run(measure(conn, args.reps, apart)),
                }
            points.append(point)
            brief = {k: v for k, v in point.items() if k != "pulls_ms"}
            print(json.dumps(brief), file=sys.stderr, flush=True)
    result = {
        "benchmark": "pull_latency",
        "pages": 3,
        "reps": args.reps,
        "ucx_tls": os.environ.get("UCX_TLS", ""),
        "points": points,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps([{k: v for k, v in pt.items() if k != "pulls_ms"} for pt in points], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
