"""The gRPC floor of a P/D request: the CPU its messages alone cost through grpc.aio, with no logic.

A P/D request through the router (`benchmarks/serving.py --overhead-only`) moves these gRPC messages:
the client's server-streamed `Generate` (one request, two responses for a two-token answer); the
router's call to the prefill on its call session (one message out, one back) and then to the decode on
its (one out, one back: the finishing message ends the call). This script runs exactly that pattern
between real processes (a client, a router, a prefill and a decode) on grpc.aio over uvloop, with call
sessions that batch what is queued in one loop iteration into one message as the real ones do, and
nothing else: no tokenizing, no engine, no KV transfer, no logging or metrics. Its CPU per request,
over all processes, divided by one bare unary RPC's (client and server, measured the same way as
`serving.py` does) is the lowest figure the real mesh could reach with this message pattern on
grpc.aio; the distance between the two is what Xavier's own code and threads cost.

    python benchmarks/grpc_floor.py --concurrency 16 --peer-delay-ms 0 15 20 --out docs/results/grpc-floor-cpu

Prints JSON and writes it to `--out` (.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

try:
    import uvloop
except ImportError:  # pragma: no cover - the services run on uvloop where it is installed
    uvloop = None  # type: ignore[assignment]

from serving import bare_rpc_cpu, cpu_seconds, start_bare_server  # benchmarks/serving.py, beside this

_SESSION = "/floor.Peer/Session"
_GENERATE = "/floor.Router/Generate"
_ID = struct.Struct("<QI")  # call id, payload length
_REQUEST = b"r" * 120  # about a GenerateRequest of a short prompt
_ANSWER = b"a" * 90  # about a PrefillResponse / a finishing DecodeResponse


def _pack(calls: list[tuple[int, bytes]]) -> bytes:
    return b"".join(_ID.pack(cid, len(body)) + body for cid, body in calls)


def _unpack(msg: bytes) -> list[tuple[int, bytes]]:
    out, at = [], 0
    while at < len(msg):
        cid, n = _ID.unpack_from(msg, at)
        at += _ID.size
        out.append((cid, msg[at : at + n]))
        at += n
    return out


class _Batches:
    """One stream's outgoing calls: everything queued while the writer waited goes as one message."""

    def __init__(self) -> None:
        self.queued: list[tuple[int, bytes]] = []
        self.ready = asyncio.Event()
        self.messages = 0
        self.calls = 0

    def put(self, cid: int, body: bytes) -> None:
        self.queued.append((cid, body))
        self.ready.set()

    async def next(self) -> bytes:
        await self.ready.wait()
        self.ready.clear()
        calls, self.queued = self.queued, []
        self.messages += 1
        self.calls += len(calls)
        return _pack(calls)


async def _peer(port_out: Any, delay: float) -> None:
    """A prefill or decode: answers each call of its session at once, or `delay` seconds later (an
    engine step's latency, so that the mesh runs at the real one's requests/s)."""
    loop = asyncio.get_running_loop()

    async def session(requests: Any, context: Any) -> Any:
        out = _Batches()

        async def read() -> None:
            async for msg in requests:
                for cid, _ in _unpack(msg):
                    if delay > 0:
                        loop.call_later(delay, out.put, cid, _ANSWER)
                    else:
                        out.put(cid, _ANSWER)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                yield await out.next()
        finally:
            reader.cancel()

    await _serve("floor.Peer", "Session", grpc.stream_stream_rpc_method_handler(session), port_out)


class _Session:
    """The router's side of one call session: calls go out batched, answers come back by call id."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.out = _Batches()
        self.waiting: dict[int, asyncio.Future[bytes]] = {}
        self.next_id = 0
        self.call = self.channel.stream_stream(_SESSION)(self._requests())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self) -> Any:
        while True:
            yield await self.out.next()

    async def _read(self) -> None:
        async for msg in self.call:
            for cid, body in _unpack(msg):
                self.waiting.pop(cid).set_result(body)

    async def unary(self, body: bytes) -> bytes:
        self.next_id += 1
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = fut
        self.out.put(self.next_id, body)
        return await fut


async def _router(prefill: str, decode: str, port_out: Any) -> None:
    """Serves Generate: the prefill's answer goes out as the first response, the decode's as the last."""
    sessions: dict[str, _Session] = {}

    async def generate(request: bytes, context: Any) -> Any:
        if not sessions:
            sessions["p"], sessions["d"] = _Session(prefill), _Session(decode)
        first = await sessions["p"].unary(request)
        yield first
        yield await sessions["d"].unary(request + first)

    await _serve("floor.Router", "Generate", grpc.unary_stream_rpc_method_handler(generate), port_out)


async def _serve(service: str, method: str, handler: grpc.RpcMethodHandler, port_out: Any) -> None:
    """Serves `service`'s one `method` on a free loopback port, which it prints to `port_out`."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, file=port_out, flush=True)
    await server.wait_for_termination()


def _spawn(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


async def _drive(
    router: str, pids: dict[int, str], bare: tuple[str, int], conc: int, n: int, delay_ms: float
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(router) as ch:
        generate = ch.unary_stream(_GENERATE)

        async def one() -> None:
            got = 0
            async for _ in generate(_REQUEST, timeout=30):
                got += 1
            if got != 2:
                raise RuntimeError(f"Generate answered {got} messages, not 2")

        for _ in range(200):  # warm up: sessions open, code paths hot
            await one()
        bare_before = await bare_rpc_cpu(*bare, conc, max(n, 2000))  # and after: as serving.py does
        sem = asyncio.Semaphore(conc)

        async def req() -> None:
            async with sem:
                await one()

        cpu0, me0, t0 = cpu_seconds(pids), time.process_time(), time.perf_counter()
        await asyncio.gather(*(req() for _ in range(n)))
        wall = time.perf_counter() - t0
        cpu1, me1 = cpu_seconds(pids), time.process_time()
    cpu = {k: (cpu1[k] - cpu0[k]) * 1e3 / n for k in cpu1}
    cpu["client"] = (me1 - me0) * 1e3 / n
    bare_after = await bare_rpc_cpu(*bare, conc, max(n, 2000))
    bare_cpu = (bare_before + bare_after) / 2
    total = sum(cpu.values())
    return {
        "concurrency": conc,
        "requests": n,
        "peer_delay_ms": delay_ms,
        "requests_per_s": round(n / wall, 1),
        "cpu_ms_per_request": {k: round(v, 4) for k, v in sorted(cpu.items())},
        "cpu_ms_per_request_total": round(total, 4),
        "cpu_ms_per_bare_rpc": round(bare_cpu, 4),
        "cpu_ms_per_bare_rpc_before_after": [round(bare_before, 4), round(bare_after, 4)],
        "cpu_per_request_over_bare_rpc": round(total / bare_cpu, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["bench", "peer", "router"], default="bench", help=argparse.SUPPRESS)
    p.add_argument("--peers", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--requests", type=int, default=6000, help="requests per concurrency level")
    p.add_argument("--rounds", type=int, default=1, help="times each level runs (each on fresh processes)")
    p.add_argument(
        "--peer-delay-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="each peer answers this long after a call arrives (0: at once), one level each: brings "
        "requests/s down to the real mesh's, where less of each gRPC wake-up is shared between requests",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    run = uvloop.run if uvloop is not None else asyncio.run
    if args.role == "peer":
        run(_peer(sys.stdout, args.peer_delay_ms[0] / 1e3))
        return 0
    if args.role == "router":
        run(_router(args.peers[0], args.peers[1], sys.stdout))
        return 0
    levels = []
    for _ in range(args.rounds):
        for conc, delay_ms in ((c, d) for c in args.concurrency for d in args.peer_delay_ms):
            procs: list[subprocess.Popen[bytes]] = []
            try:
                delay = ("--peer-delay-ms", str(delay_ms))
                pre, pre_addr = _spawn("--role", "peer", *delay)
                dec, dec_addr = _spawn("--role", "peer", *delay)
                rtr, rtr_addr = _spawn("--role", "router", "--peers", pre_addr, dec_addr)
                bare, bare_addr = start_bare_server()
                procs = [pre, dec, rtr, bare]
                pids = {pre.pid: "prefill", dec.pid: "decode", rtr.pid: "router"}
                bare_server = (bare_addr, bare.pid)
                levels.append(run(_drive(rtr_addr, pids, bare_server, conc, args.requests, delay_ms)))
                print(json.dumps(levels[-1]), file=sys.stderr, flush=True)
            finally:
                for proc in procs:
                    proc.terminate()
                    proc.wait(10)
    result = {"benchmark": "grpc_floor", "cores": os.cpu_count(), "grpc": grpc.__version__, "levels": levels}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
