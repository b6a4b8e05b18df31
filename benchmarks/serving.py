"""Serving benchmark: TTFT, TPOT and output tokens/s of `pd` vs `colocated`, and control-plane overhead.

Starts `xavier up` (one prefill, one decode and one unified replica of the same engine and checkpoint),
then for each concurrency level and mode streams fixed-seed prompts through the SDK:

* TTFT p50/p99: client send → first streamed token.
* TPOT p50: (last token - first token) / (tokens - 1), per request.
* output tok/s: generated tokens / wall time of the level.
* control-plane overhead (P/D), on a second mesh whose engines run with `--compute null` (the real
  scheduler, paging, KV pool and NIXL transfer, with a zero-compute model): TTFT of a two-token request,
  i.e. tokenization, peer selection, the Prefill RPC and the streaming hops; and the whole
  lifecycle (publish, Decode, BeginTransfer, NIXL read, CompleteRoom, the second token). Beside it a bare
  grpc.aio unary round trip (health Check on the directory process) at the same concurrency, and the CPU
  of one bare round trip, client and server together (a server process that serves only health, so the
  CPU ratio says how many bare RPCs' worth of work one P/D request costs all processes). Two tokens,
  not one, so every request runs the whole P/D lifecycle as real traffic does: a one-token request ends
  at the prefill and takes the abort path instead. The model mesh is stopped first: both never share
  the CPU.

    python benchmarks/serving.py [--model DIR] [--out benchmarks/results/serving] [--max-tokens 32]

Prints JSON; writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xavier.v1 import directory_service_pb2 as dir_pb
from xavier.v1 import directory_service_pb2_grpc as dir_grpc
from xavier_client import AsyncClient

_WORDS = (
    "the quick brown fox jumps over a lazy dog while machine learning models predict the next word".split()
)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(16, 64))) for _ in range(n)]


def _services(svc_dir: Path) -> dict[int, str]:
    """pid -> service name, from the ready files `xavier up` has its children write."""
    return {int(json.loads(r.read_text())["pid"]): r.stem for r in svc_dir.glob("*.ready")}


def cpu_seconds(pids: dict[int, str]) -> dict[str, float]:
    """User + system CPU seconds per service so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, name in pids.items():
        try:
            fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


_BARE_SERVER = """
import asyncio, grpc
from grpc_health.v1 import health, health_pb2_grpc

async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

try:
    import uvloop  # the services run on uvloop when it is installed; the baseline does too
except ImportError:
    asyncio.run(main())
else:
    uvloop.run(main())
"""


def start_bare_server() -> tuple[subprocess.Popen[bytes], str]:
    """A process serving only grpc.aio health: the bare-RPC CPU baseline's server side."""
    proc = subprocess.Popen([sys.executable, "-c", _BARE_SERVER], stdout=subprocess.PIPE)
    if proc.stdout is None:
        raise RuntimeError("the bare server's stdout is not a pipe")
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


def start_mesh(
    workdir: Path,
    model: Path | None,
    device: str = "cpu",
    compute: str = "model",
    pagestore: bool = False,
    protocol: str = "pair",
    etcd: str = "",
    sessions: bool = True,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "up.json"
    cmd = [
        str(Path(sys.executable).parent / "xavier"),
        "up",
        "--insecure",  # plaintext, as docs/results were measured: this script dials the services directly
        "--grpc",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--unified",
        "1",
        "--workdir",
        str(workdir / "svc"),
        "--ready-file",
        str(ready),
        "--device",
        device,
        "--compute",
        compute,
        # The page store adds a lookup to every prefill and a write-through after it: off unless asked for,
        # so the figures are P/D's and colocated serving's own.
        "--pagestore" if pagestore else "--no-pagestore",
        # The router's calls to peers: one call session per peer, or one RPC per call.
        "--peer-sessions" if sessions else "--no-peer-sessions",
    ]
    if model is not None:
        cmd += ["--model", str(model)]
    log = open(workdir / "up.log", "wb")
    env = {**os.environ, "XAVIER_HANDOFF__PROTOCOL": protocol}
    if etcd:  # the directory keeps peers and rooms in this etcd (host:port)
        env |= {
            "XAVIER_DIRECTORY__BACKEND": "etcd",
            "XAVIER_DIRECTORY__ETCD_ENDPOINTS": f'["{etcd}"]',
            "XAVIER_DIRECTORY__ETCD_PREFIX": f"/xavier/bench-{workdir.name}/",  # one mesh's, not the last's
        }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((workdir / "up.log").read_text())
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


async def one(client: AsyncClient, prompt: str, mode: str, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    prefill = 0.0
    async for chunk in client.generate_stream(prompt, max_tokens=max_tokens, mode=mode, ignore_eos=True):  # type: ignore[arg-type]
        now = time.perf_counter()
        if chunk.token_ids:
            if n == 0:
                first = now
            last = now
            n += len(chunk.token_ids)
        if chunk.raw is not None and chunk.raw.HasField("timings"):
            prefill = chunk.raw.timings.prefill.ToTimedelta().total_seconds()
    tpot = (last - first) / (n - 1) if n > 1 else 0.0
    return {"ttft": first - t0, "tpot": tpot, "tokens": n, "prefill": prefill}


async def one_http(
    web: aiohttp.ClientSession, address: str, prompt: str, max_tokens: int
) -> dict[str, float]:
    """`one` through the router's OpenAI API: a streamed `/v1/completions` in P/D mode."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "xavier_mode": "pd",
    }
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    async with web.post(f"http://{address}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if n == 0:
                first = now
            last = now
            n += 1
    tpot = (last - first) / (n - 1) if n > 1 else 0.0
    return {"ttft": first - t0, "tpot": tpot, "tokens": n, "prefill": 0.0}


async def level(address: str, mode: str, conc: int, n: int, max_tokens: int, seed: int) -> dict[str, Any]:
    ps = prompts(n, seed)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in ps:
        queue.put_nowait(p)
    results: list[dict[str, float]] = []
    async with AsyncClient(address, timeout=300) as client:
        await one(client, "warm up", mode, 2)

        async def worker() -> None:
            while not queue.empty():
                results.append(await one(client, queue.get_nowait(), mode, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["tpot"] * 1e3 for r in results]
    return {
        "mode": mode,
        "concurrency": conc,
        "requests": n,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50),
        "tpot_ms_p99": pct(tpot, 99),
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
    }


async def bare_rpc_cpu(address: str, pid: int, conc: int, n: int) -> float:
    """CPU ms of one bare grpc.aio unary round trip at `conc`: this process plus the bare server's."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(50):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        sem = asyncio.Semaphore(conc)
        server0, me0 = cpu_seconds({pid: "bare"})["bare"], time.process_time()

        async def rt() -> None:
            async with sem:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

        await asyncio.gather(*(rt() for _ in range(n)))
        server1, me1 = cpu_seconds({pid: "bare"})["bare"], time.process_time()
    return (server1 - server0 + me1 - me0) * 1e3 / n


async def overhead(
    address: str,
    directory: str,
    conc: int,
    n: int,
    pids: dict[int, str],
    bare_server: tuple[str, int],
    tokens: int = 2,
    http: str = "",
) -> dict[str, Any]:
    """P/D control-plane cost per request on a zero-compute mesh, beside a bare grpc.aio round trip;
    with `http` (the router's OpenAI address), the requests stream `/v1/completions` over HTTP instead
    of the gRPC API (no engine time comes back there: the overhead figures are then TTFT's)."""
    ps = prompts(n, 99)
    ttft: list[float] = []
    total: list[float] = []
    engine: list[float] = []
    async with AsyncClient(address, timeout=60) as client:
        for _ in range(20):
            await one(client, "warm up", "pd", 2)
        # The bare round trip is measured just before and just after the level, and the two averaged:
        # the box's speed drifts over minutes, and one measurement apart from the level swung the ratio.
        bare_before = await bare_rpc_cpu(*bare_server, conc, max(n, 2000))
        sem = asyncio.Semaphore(conc)
        cpu0, me0, t_start = cpu_seconds(pids), time.process_time(), time.perf_counter()

        web = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) if http else None

        async def req(p: str) -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await (one_http(web, http, p, tokens) if web else one(client, p, "pd", tokens))
                total.append((time.perf_counter() - t0) * 1e3)
                ttft.append(r["ttft"] * 1e3)
                engine.append(r["prefill"] * 1e3)

        rooms0 = await directory_rooms(directory)
        try:
            await asyncio.gather(*(req(p) for p in ps))
        finally:
            if web is not None:
                await web.close()
        wall = time.perf_counter() - t_start
        cpu1, me1 = cpu_seconds(pids), time.process_time()
        rooms = (await directory_rooms(directory) - rooms0) / n
    cpu = {k: (cpu1[k] - cpu0.get(k, 0.0)) * 1e3 / n for k in cpu1}
    cpu["client"] = (me1 - me0) * 1e3 / n
    control = [t - e for t, e in zip(ttft, engine, strict=True)]
    bare: list[float] = []
    async with grpc.aio.insecure_channel(directory) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        sem = asyncio.Semaphore(conc)

        async def rt() -> None:
            async with sem:
                t0 = time.perf_counter()
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                bare.append((time.perf_counter() - t0) * 1e3)

        await asyncio.gather(*(rt() for _ in range(n)))
    bare_after = await bare_rpc_cpu(*bare_server, conc, max(n, 2000))
    bare_cpu = (bare_before + bare_after) / 2
    cpu_total = sum(cpu.values())
    return {
        "concurrency": conc,
        "requests": n,
        "tokens": tokens,
        "api": "openai-http" if http else "grpc",
        # TTFT less the time the prefill service reports for its engine (queue + step, zero compute).
        "overhead_ms_p50": pct(control, 50),
        "overhead_ms_p99": pct(control, 99),
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "lifecycle_ms_p50": pct(total, 50),
        "lifecycle_ms_p99": pct(total, 99),
        "engine_prefill_ms_p50": pct(engine, 50),
        "bare_grpc_ms_p50": pct(bare, 50),
        "bare_grpc_ms_p99": pct(bare, 99),
        "cpu_ms_per_bare_rpc": round(bare_cpu, 4),
        "cpu_ms_per_bare_rpc_before_after": [round(bare_before, 4), round(bare_after, 4)],
        "requests_per_s": n / wall,
        "cpu_ms_per_request": {k: round(v, 3) for k, v in sorted(cpu.items())},
        "cpu_ms_per_request_total": round(cpu_total, 3),
        "cpu_per_request_over_bare_rpc": round(cpu_total / bare_cpu, 1),
        "directory_rooms_per_request": round(rooms, 3),
    }


async def directory_rooms(address: str) -> int:
    """Rooms the directory opened so far (a P/D request on directory rooms opens one)."""
    async with grpc.aio.insecure_channel(address) as ch:
        stats = await dir_grpc.DirectoryServiceStub(ch).GetDirectoryStats(
            dir_pb.GetDirectoryStatsRequest(), timeout=5
        )
    return int(stats.rooms_opened)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    for mode in ("pd", "colocated"):
        rows = [r for r in result.get("levels", []) if r["mode"] == mode]
        xs = [r["concurrency"] for r in rows]
        axes[0].plot(xs, [r["ttft_ms_p50"] for r in rows], "o-", label=f"{mode} p50")
        axes[0].plot(xs, [r["ttft_ms_p99"] for r in rows], "x--", label=f"{mode} p99")
        axes[1].plot(xs, [r["tpot_ms_p50"] for r in rows], "o-", label=mode)
        axes[2].plot(xs, [r["output_tok_s"] for r in rows], "o-", label=mode)
    for ax, title in zip(axes[:3], ("TTFT (ms)", "TPOT p50 (ms)", "output tokens/s"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("concurrency")
        ax.legend()
    ov = result["overhead"]
    labels = [f"c={o['concurrency']}" for o in ov]
    xs = range(len(ov))
    axes[3].bar([x - 0.2 for x in xs], [o["overhead_ms_p50"] for o in ov], 0.2, label="P/D overhead p50")
    axes[3].bar(list(xs), [o["overhead_ms_p99"] for o in ov], 0.2, label="P/D overhead p99")
    axes[3].bar([x + 0.2 for x in xs], [o["bare_grpc_ms_p50"] for o in ov], 0.2, label="bare grpc.aio p50")
    axes[3].set_xticks(list(xs), labels)
    axes[3].set_title("control-plane overhead (ms)")
    axes[3].legend()
    axes[4].bar([x - 0.2 for x in xs], [o["cpu_ms_per_request_total"] for o in ov], 0.4, label="P/D request")
    axes[4].bar([x + 0.2 for x in xs], [o["cpu_ms_per_bare_rpc"] for o in ov], 0.4, label="bare grpc.aio RPC")
    axes[4].set_xticks(list(xs), labels)
    axes[4].set_title("CPU ms per call, all processes")
    axes[4].legend()
    fig.suptitle(f"Xavier serving on {result['device']} ({result['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run_levels(args: argparse.Namespace, info: dict[str, Any]) -> list[dict[str, Any]]:
    levels = []
    for conc in args.concurrency:
        for mode in ("pd", "colocated"):
            n = max(8, conc * args.requests_per_client)
            levels.append(await level(info["grpc"], mode, conc, n, args.max_tokens, seed=conc))
            print(json.dumps(levels[-1]), file=sys.stderr, flush=True)
    return levels


async def run_overhead(
    args: argparse.Namespace, info: dict[str, Any], pids: dict[int, str]
) -> list[dict[str, Any]]:
    out = []
    bare, bare_address = start_bare_server()
    try:
        for conc in args.concurrency:
            n = max(args.overhead_requests, 40 * conc)
            out.append(
                await overhead(
                    info["grpc"],
                    info["directory"],
                    conc,
                    n,
                    pids,
                    (bare_address, bare.pid),
                    args.overhead_tokens,
                    info["http"] if args.overhead_api == "http" else "",
                )
            )
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    finally:
        bare.terminate()
        bare.wait(10)
    return out


def decode_run_lengths(svc_dir: Path) -> dict[str, int]:
    """The decodes' run-length histogram (`xavier_transfer_run_length_pages`, per bucket, summed over
    decode peers) scraped from their /metrics now."""
    import urllib.request

    out: dict[str, int] = {}
    for ready in svc_dir.glob("*decode*.ready"):
        address = json.loads(ready.read_text()).get("metrics")
        if not address:
            continue
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("xavier_transfer_run_length_pages_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[le] = out.get(le, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


async def run_lengths(args: argparse.Namespace, info: dict[str, Any], svc_dir: Path) -> list[dict[str, Any]]:
    """Page-run lengths the decode pulled at each concurrency, after a warm-up level at that
    concurrency (a pool that has served traffic hands out scattered pages)."""
    out = []
    for conc in args.run_length_concurrency:
        n = max(8, conc * args.requests_per_client)
        await level(info["grpc"], "pd", conc, n, args.max_tokens, seed=conc + 1)  # warm-up
        before = decode_run_lengths(svc_dir)
        await level(info["grpc"], "pd", conc, n, args.max_tokens, seed=conc + 2)
        after = decode_run_lengths(svc_dir)
        cumulative = {le: after[le] - before.get(le, 0) for le in after}
        runs = max(cumulative.values(), default=0)
        per_bucket, prev = {}, 0
        for le, c in cumulative.items():  # the exposition lists buckets in increasing order
            per_bucket[le], prev = c - prev, c
        out.append({"concurrency": conc, "runs": runs, "runs_by_length_le": per_bucket})
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serving"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, or cuda to spread engines over the GPUs")
    p.add_argument("--overhead-only", action="store_true", help="only the zero-compute overhead part")
    p.add_argument(
        "--run-lengths", action="store_true", help="also record the page-run lengths the decode pulls"
    )
    p.add_argument("--run-length-concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--pagestore", action="store_true", help="meshes with a page store (default: none)")
    p.add_argument(
        "--overhead-requests",
        type=int,
        default=600,
        help="requests per concurrency level of the overhead part (at least 40 per concurrent client)",
    )
    p.add_argument(
        "--overhead-tokens",
        type=int,
        default=2,
        help="tokens each request of the overhead part streams (2: the control-plane figure; more: the "
        "per-token path through the services)",
    )
    p.add_argument(
        "--overhead-api",
        choices=["grpc", "http"],
        default="grpc",
        help="the API the overhead part's requests use: the router's gRPC API, or its OpenAI HTTP API",
    )
    p.add_argument(
        "--protocols",
        type=lambda v: v.split(","),
        default=["pair"],
        help="P/D handoff protocols of the overhead part, one mesh each in this order (pair,directory)",
    )
    p.add_argument(
        "--directory-backend",
        choices=["memory", "etcd"],
        default="memory",
        help="where the directory keeps peers and rooms (etcd: a private one on disk, as in directory.py)",
    )
    p.add_argument(
        "--sessions",
        type=lambda v: v.split(","),
        default=["on"],
        help="the router's peer calls in the overhead part: on (call sessions), off (one RPC each), or "
        "both in this order (off,on), one mesh each",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="times the overhead meshes run, alternating in their order"
    )
    args = p.parse_args()
    if set(args.sessions) - {"on", "off"}:
        p.error(f"--sessions takes on and off, got {','.join(args.sessions)}")
    workdir = Path(tempfile.mkdtemp(prefix="xavier-bench-"))
    etcd = ""
    if args.directory_backend == "etcd":
        from directory import start_etcd  # benchmarks/directory.py, beside this script

        etcd_proc, etcd = start_etcd(workdir)
    meshes = {"model": ("levels", run_levels), "null": ("overhead", run_overhead)}
    result: dict[str, Any] = {
        "device": args.device,
        "cores": os.cpu_count(),
        "max_tokens": args.max_tokens,
        "pagestore": args.pagestore,
        "directory_backend": args.directory_backend,
    }
    runs = [("model", args.protocols[0], args.sessions[-1], 0)] if not args.overhead_only else []
    runs += [
        ("null", protocol, sessions, n)
        for n in range(args.rounds)
        for protocol in args.protocols
        for sessions in args.sessions
    ]
    for compute, protocol, sessions, n in runs:
        where = workdir / f"{compute}-{protocol}-sessions-{sessions}-{n}"
        proc, info = start_mesh(
            where, args.model, args.device, compute, args.pagestore, protocol, etcd, sessions == "on"
        )
        try:
            key, fn = meshes[compute]
            result["model"] = Path(info["model"]).name
            coro = fn(args, info) if compute == "model" else fn(args, info, _services(where / "svc"))
            out = _run_loop(coro)
            if compute == "null":  # the first protocol's is "overhead"; each one's by protocol
                result.setdefault(key, out)
                result.setdefault("overhead_by_protocol", {}).setdefault(protocol, out)
                by_sessions = result.setdefault("overhead_by_sessions", {}).setdefault(protocol, {})
                by_sessions.setdefault(sessions, []).append(out)
            else:
                result[key] = out
            if compute == "model" and args.run_lengths:
                result["run_lengths"] = _run_loop(run_lengths(args, info, where / "svc"))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if etcd:
        etcd_proc.terminate()
        etcd_proc.wait(30)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
