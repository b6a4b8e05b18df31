"""Serving benchmark: TTFT, TPOT and output tokens/s of `pd` vs `colocated`, and control-plane overhead.

Starts `xavier up` (one prefill, one decode and one unified replica of the same engine and checkpoint),
then for each concurrency level and mode streams fixed-seed prompts through the SDK:

* TTFT p50/p99: client send → first streamed token.
* TPOT p50: (last token - first token) / (tokens - 1), per request.
* output tok/s: generated tokens / wall time of the level.
* control-plane overhead (P/D): TTFT of a two-token request minus the prefill compute the prefill
  service reports, i.e. tokenization, peer selection, OpenRoom, the Prefill RPC and the streaming hops,
  with the model's own compute taken out; beside it a bare grpc.aio unary round trip (health Check on the
  directory process) in the same run. Two tokens, not one, so every request runs the whole P/D lifecycle
  (publish, watch, transfer, complete, release) as real traffic does: a one-token request ends at the
  prefill and takes the abort path instead, whose clean-up then overlaps the next request.

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

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
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


def start_mesh(
    workdir: Path, model: Path | None, device: str = "cpu"
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    ready = workdir / "up.json"
    cmd = [
        str(Path(sys.executable).parent / "xavier"),
        "up",
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
    ]
    if model is not None:
        cmd += ["--model", str(model)]
    log = open(workdir / "up.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


async def overhead(address: str, directory: str, conc: int, n: int) -> dict[str, Any]:
    """P/D control-plane overhead per request beside a bare grpc.aio round trip, same concurrency."""
    ps = prompts(n, 99)
    over: list[float] = []
    async with AsyncClient(address, timeout=60) as client:
        await one(client, "warm up", "pd", 2)
        sem = asyncio.Semaphore(conc)

        async def req(p: str) -> None:
            async with sem:
                r = await one(client, p, "pd", 2)
                over.append((r["ttft"] - r["prefill"]) * 1e3)

        await asyncio.gather(*(req(p) for p in ps))
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
    return {
        "concurrency": conc,
        "requests": n,
        "overhead_ms_p50": pct(over, 50),
        "overhead_ms_p99": pct(over, 99),
        "bare_grpc_ms_p50": pct(bare, 50),
        "bare_grpc_ms_p99": pct(bare, 99),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for mode in ("pd", "colocated"):
        rows = [r for r in result["levels"] if r["mode"] == mode]
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
    fig.suptitle(f"Xavier serving on {result['device']} ({result['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    levels = []
    for conc in args.concurrency:
        for mode in ("pd", "colocated"):
            n = max(8, conc * args.requests_per_client)
            levels.append(await level(info["grpc"], mode, conc, n, args.max_tokens, seed=conc))
            print(json.dumps(levels[-1]), file=sys.stderr, flush=True)
    ov = [await overhead(info["grpc"], info["directory"], c, 200 if c == 1 else 320) for c in (1, 16)]
    return {
        "model": Path(info["model"]).name,
        "device": args.device,
        "cores": os.cpu_count(),
        "max_tokens": args.max_tokens,
        "levels": levels,
        "overhead": ov,
    }


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
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="xavier-bench-"))
    proc, info = start_mesh(workdir, args.model, args.device)
    try:
        result = _run_loop(run(args, info))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
