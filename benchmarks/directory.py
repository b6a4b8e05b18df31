"""Directory throughput: full room lifecycles per second and per-RPC latency, against a bare baseline.

Starts ``xavier-directory`` as a process on 127.0.0.1:0 once per backend (memory, and etcd: a private
``etcd`` on a temporary data directory on disk, fsync and all), registers one prefill and one decode peer, and
runs full lifecycles (open → watch → publish → see SOURCE_READY → complete → release prefill → release
decode → watch ends RELEASED) from 1 and from 16 concurrent clients for a fixed time each. In the same
run it measures a bare ``grpc.aio`` health-check round trip against the same process as the baseline.

    python benchmarks/directory.py [--seconds 5] [--clients 1,16] [--backends memory,etcd]
                                   [--out result.json] [--plot result.png]

Prints one JSON object: per backend, rates and p50/p99 per RPC in milliseconds; then one summary line of
lifecycles/s per backend and client count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import types_pb2

SEED = 20261129


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def _summary(lat: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {"n": len(v), "p50_ms": round(_pct(v, 0.5), 3), "p99_ms": round(_pct(v, 0.99), 3)}
        for name, v in sorted(lat.items())
    }


def start_etcd(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A single-member etcd on free loopback ports (Debian's etcd-server; scripts/setup.sh installs it)."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    client, peer = (f"http://127.0.0.1:{p}" for p in ports)
    args = [
        shutil.which("etcd") or "/usr/bin/etcd", "--name", "b", "--data-dir", str(workdir / "etcd"),
        "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer, "--initial-cluster", f"b={peer}", "--log-level", "error",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(workdir / "etcd.log", "wb"))
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", ports[0])) == 0:
                return proc, f"127.0.0.1:{ports[0]}"
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"etcd did not start: {(workdir / 'etcd.log').read_text()}")
        time.sleep(0.05)


def start_directory(workdir: Path, etcd: str = "") -> tuple[subprocess.Popen[bytes], str]:
    ready = workdir / "directory.ready"
    backend = (
        {"XAVIER_DIRECTORY__BACKEND": "etcd", "XAVIER_DIRECTORY__ETCD_ENDPOINTS": f'["{etcd}"]'}
        if etcd
        else {}
    )
    env = {
        **os.environ,
        **backend,
        "XAVIER_DIRECTORY__MAX_ROOMS": "100000",
        "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "3600",
        "XAVIER_LOG_LEVEL": "warning",
        "XAVIER_METRICS_LISTEN": "",
    }
    exe = str(Path(sys.executable).parent / "xavier-directory")
    log = open(workdir / "directory.log", "wb")
    proc = subprocess.Popen(
        [exe, "--listen", "127.0.0.1:0", "--ready-file", str(ready)], stdout=log, stderr=log, env=env
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"directory did not start: {(workdir / 'directory.log').read_text()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"]


async def register(stub: dpb_grpc.DirectoryServiceStub) -> tuple[dpb.Peer, dpb.Peer]:
    layout = types_pb2.KvLayout(
        engine="reference", dtype="float16", num_layers=28, num_kv_heads=8, head_dim=128, page_size=16,
        memory_layout="mha_layer_kv_slot_head_dim", weights_fingerprint="w" * 64,
    )  # fmt: skip
    ep = types_pb2.TransferEndpoint(kind=types_pb2.TRANSPORT_KIND_NIXL, agent_name="bench")
    peers = []
    for peer_id, role in (("bench-p", types_pb2.ROLE_PREFILL), ("bench-d", types_pb2.ROLE_DECODE)):
        req = dpb.RegisterPeerRequest(
            peer_id=peer_id, role=role, address="127.0.0.1:1", layout=layout, endpoint=ep
        )
        peers.append((await stub.RegisterPeer(req, timeout=5)).peer)
    return peers[0], peers[1]


async def lifecycle_worker(
    stub: dpb_grpc.DirectoryServiceStub,
    p: dpb.Peer,
    d: dpb.Peer,
    stop_at: float,
    lat: dict[str, list[float]],
    rng: random.Random,
) -> int:
    done = 0
    clock = time.perf_counter
    src = dpb.SourceDescriptor(
        page_runs=[types_pb2.PageRun(first_page=rng.randrange(1000), count=8)],
        num_pages=8,
        num_tokens=128,
    )
    pair = dict(
        prefill_peer_id=p.peer_id, prefill_epoch=p.epoch, decode_peer_id=d.peer_id, decode_epoch=d.epoch
    )
    while clock() < stop_at:
        # A P/D request as the services make it: the decode opens the room and waits in BeginTransfer,
        # the prefill publishes into it, the decode completes it.
        rid = rng.getrandbits(63) or 1
        begin = stub.BeginTransfer(
            dpb.BeginTransferRequest(request_id=f"b{rid}", room_id=rid, wait_for_source=True, **pair),
            timeout=10,
        )
        t = clock()
        pub = dpb.PublishSourceRequest(request_id=f"p{rid}", room_id=rid, source=src, **pair)
        await stub.PublishSource(pub, timeout=5)
        lat["PublishSource"].append(clock() - t)
        began = await begin
        lat["BeginTransfer.wait"].append(clock() - t)
        assert began.room.state == dpb.ROOM_STATE_TRANSFERRING
        t = clock()
        done_req = dpb.CompleteRoomRequest(
            request_id=f"c{rid}", room_id=rid, peer_id=d.peer_id, epoch=d.epoch
        )
        completed = await stub.CompleteRoom(done_req, timeout=5)
        lat["CompleteRoom"].append(clock() - t)
        assert completed.room.state == dpb.ROOM_STATE_COMPLETED
        done += 1
    return done


async def health_worker(stub: health_pb2_grpc.HealthStub, stop_at: float, lat: list[float]) -> int:
    n = 0
    req = health_pb2.HealthCheckRequest(service="")
    clock = time.perf_counter
    while clock() < stop_at:
        t = clock()
        await stub.Check(req, timeout=5)
        lat.append(clock() - t)
        n += 1
    return n


async def run(address: str, seconds: float, clients: list[int]) -> dict[str, Any]:
    rng = random.Random(SEED)
    out: dict[str, Any] = {"baseline_health_check": {}, "lifecycles": {}}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = dpb_grpc.DirectoryServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        p, d = await register(stub)
        warm: dict[str, list[float]] = defaultdict(list)
        await lifecycle_worker(stub, p, d, time.perf_counter() + 0.5, warm, rng)
        for n in clients:
            lat: list[float] = []
            start = time.perf_counter()
            counts = await asyncio.gather(*(health_worker(health, start + seconds, lat) for _ in range(n)))
            elapsed = time.perf_counter() - start
            out["baseline_health_check"][str(n)] = {
                "rpc_per_s": round(sum(counts) / elapsed, 1),
                "p50_ms": round(_pct(lat, 0.5), 3),
                "p99_ms": round(_pct(lat, 0.99), 3),
            }
            lats: dict[str, list[float]] = defaultdict(list)
            start = time.perf_counter()
            done = await asyncio.gather(
                *(
                    lifecycle_worker(stub, p, d, start + seconds, lats, random.Random(rng.random()))
                    for _ in range(n)
                )
            )
            elapsed = time.perf_counter() - start
            unary = [v for k, vs in lats.items() if not k.endswith(".wait") for v in vs]
            out["lifecycles"][str(n)] = {
                "lifecycles_per_s": round(sum(done) / elapsed, 1),
                "unary_rpc_per_s": round(len(unary) / elapsed, 1),
                "unary_p50_ms": round(_pct(unary, 0.5), 3),
                "unary_p99_ms": round(_pct(unary, 0.99), 3),
                "per_rpc": _summary(lats),
            }
        stats = await stub.GetDirectoryStats(dpb.GetDirectoryStatsRequest(), timeout=5)
        out["rooms_active_after"] = stats.rooms_active
        out["rooms_completed"] = stats.rooms_completed
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ns = list(result["lifecycles"])
    ax1.bar([f"{n} clients" for n in ns], [result["lifecycles"][n]["lifecycles_per_s"] for n in ns])
    ax1.set_ylabel("lifecycles / s")
    rpcs = sorted(result["lifecycles"][ns[-1]]["per_rpc"])
    for i, n in enumerate(ns):
        per = result["lifecycles"][n]["per_rpc"]
        ax2.bar(
            [j + 0.4 * i for j in range(len(rpcs))],
            [per[r]["p99_ms"] for r in rpcs],
            width=0.4,
            label=f"{n} clients",
        )
    for n in ns:
        ax2.axhline(result["baseline_health_check"][n]["p99_ms"], linestyle="--", linewidth=0.8)
    ax2.set_xticks([j + 0.2 for j in range(len(rpcs))], rpcs, rotation=30, ha="right", fontsize=7)
    ax2.set_ylabel("p99 ms (dashed: health-check baseline)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--backends", default="memory,etcd", help="directory backends, one run each")
    parser.add_argument("--address", default="", help="use a running directory instead of starting one")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    clients = [int(x) for x in args.clients.split(",")]
    result: dict[str, Any] = {"backends": {}}
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            procs: list[subprocess.Popen[bytes]] = []
            address = args.address
            try:
                if not address:
                    etcd = ""
                    if backend == "etcd":
                        etcd_proc, etcd = start_etcd(Path(tmp))
                        procs.append(etcd_proc)
                    proc, address = start_directory(Path(tmp), etcd)
                    procs.insert(0, proc)
                result["backends"][backend] = asyncio.run(run(address, args.seconds, clients))
            finally:
                for proc in procs:
                    proc.terminate()
                    proc.wait(10)
    result["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
    }
    result["seconds_per_point"] = args.seconds
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print(
        "lifecycles/s: "
        + "; ".join(
            f"{b} "
            + ", ".join(f"{n} client(s) {r['lifecycles'][n]['lifecycles_per_s']}" for n in r["lifecycles"])
            for b, r in result["backends"].items()
        )
    )
    if args.plot:
        plot(result["backends"][next(iter(result["backends"]))], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
