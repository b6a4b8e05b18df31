"""Goodput at equal GPUs: P/D (1 prefill + 1 decode) against two colocated replicas behind the router.

Goodput (DistServe's measure) is the highest request rate at which at least `--attainment` of requests
meet both service-level objectives: TTFT ≤ `--ttft-slo` and TPOT ≤ `--tpot-slo` (a failed request meets
neither). For each setup (`xavier up`, the same engine and checkpoint; `pd` is `--mode pd --prefill 1
--decode 1`, `colocated` is `--mode colocated --unified 2`, spread over `--gpus` round-robin) and each
rate, requests arrive as a Poisson process (seeded) for `--duration` seconds, each a fresh prompt of a
length drawn from `--lens LO-HI` (no two share a prefix) streamed through the OpenAI API with
`--max-tokens` out. Per rate: attainment, TTFT/TPOT p50/p90/p99, errors. Per setup: the goodput, found
between the swept rates by linear interpolation of attainment; and the ratio of the two setups' goodputs.
Rounds alternate the setup order.

    python benchmarks/goodput.py --engine sglang --gpus 0,1 --rates 1,2,4,8,12 --lens 2000-8000 \\
        --out docs/results/goodput-h200x2
    python benchmarks/goodput.py --engine reference --rates 2,4 --duration 8 --lens 40-160 \\
        --max-tokens 16 --ttft-slo 2 --tpot-slo 0.5 --out /tmp/goodput-cpu    # a CPU run of the machinery

Prints JSON; writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from sglang_pd import SGLANG_LAUNCHER, _events, launch_up, make_model, pct, stop

SETUPS = {
    "pd": ["--mode", "pd", "--prefill", "1", "--decode", "1"],
    "colocated": ["--mode", "colocated", "--unified", "2"],
}
SGLANG_ARGS = [
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.35",
    "--cuda-graph-max-bs", "64", "--log-level", "warning",
]  # fmt: skip


def start(setup: str, args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`xavier up` for `setup`; returns its process and HTTP base URL."""
    engine = ["--engine", args.engine]
    if args.engine == "sglang":
        engine += ["--gpus", args.gpus, "--sglang-command", SGLANG_LAUNCHER,
                   *(f"--sglang-arg={a}" for a in SGLANG_ARGS + args.sglang_arg)]  # fmt: skip
    elif args.device:
        engine += ["--device", args.device]
    flags = ["--insecure", "--model", str(args.model), "--no-pagestore", *SETUPS[setup], *engine]
    proc, ready = launch_up(work / setup, flags, timeout=1200)
    return proc, "http://" + ready["http"]


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, duration) at `rate` per second."""
    rng, t = random.Random(seed), 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def prompts(n: int, lens: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(*lens))] for _ in range(n)]


async def one(
    s: aiohttp.ClientSession, base: str, model: str, ids: list[int], max_tokens: int
) -> dict[str, Any]:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0, first, n, err = time.perf_counter(), None, 0, None
    try:
        async with s.post(base + "/v1/completions", json=body) as r:
            async for ev in _events(r):
                if ev.get("choices") and first is None:
                    first = time.perf_counter()
                if ev.get("usage"):
                    n = int(ev["usage"].get("completion_tokens", 0))
    except Exception as e:  # counted as a request that met no objective
        err = repr(e)[:200]
    end = time.perf_counter()
    ttft = None if first is None else first - t0
    tpot = None if first is None or n < 2 else (end - first) / (n - 1)
    return {"ttft": ttft, "tpot": tpot, "tokens": n, "error": err, "prompt": len(ids)}


async def at_rate(base: str, rate: float, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    times = arrivals(rate, args.duration, seed)
    ps = prompts(len(times), args.lens, args.vocab, seed + 1)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=conn) as s:
        model = (await (await s.get(base + "/v1/models")).json())["data"][0]["id"]
        await one(s, base, model, prompts(1, args.lens, args.vocab, 7)[0], args.max_tokens)  # warm-up
        t0 = time.perf_counter()

        async def at(t: float, ids: list[int]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            return await one(s, base, model, ids, args.max_tokens)

        recs = await asyncio.gather(*(at(t, ids) for t, ids in zip(times, ps, strict=True)))
        wall = time.perf_counter() - t0
    good = [
        r
        for r in recs
        if r["error"] is None
        and r["ttft"] is not None
        and r["ttft"] <= args.ttft_slo
        and (r["tpot"] is None or r["tpot"] <= args.tpot_slo)
        and r["tokens"] == args.max_tokens
    ]
    ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
    tpot = [r["tpot"] for r in recs if r["tpot"] is not None]
    errors = [r["error"] for r in recs if r["error"]]
    return {
        "rate": rate, "requests": len(recs), "attainment": len(good) / len(recs) if recs else 0.0,
        "errors": len(errors), "first_error": errors[0] if errors else None, "wall_s": round(wall, 2),
        "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "ttft_p99": pct(ttft, 0.99),
        "tpot_p50": pct(tpot, 0.5), "tpot_p90": pct(tpot, 0.9), "tpot_p99": pct(tpot, 0.99),
    }  # fmt: skip


def goodput(points: list[dict[str, Any]], attainment: float) -> float:
    """The highest rate whose attainment reaches `attainment`, interpolated between swept rates (0 when
    even the lowest misses; the highest swept rate when none does)."""
    pts = sorted(points, key=lambda p: p["rate"])
    if not pts or pts[0]["attainment"] < attainment:
        return 0.0
    for lo, hi in itertools.pairwise(pts):
        if hi["attainment"] < attainment:
            frac = (lo["attainment"] - attainment) / (lo["attainment"] - hi["attainment"])
            return float(lo["rate"] + frac * (hi["rate"] - lo["rate"]))
    return float(pts[-1]["rate"])


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for setup, rounds in report["setups"].items():
        for i, points in enumerate(rounds):
            xs = [p["rate"] for p in points]
            ax.plot(xs, [p["attainment"] for p in points], marker="o", label=f"{setup} (round {i + 1})")
    ax.axhline(report["attainment"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel(f"SLO attainment (TTFT ≤ {report['ttft_slo']} s, TPOT ≤ {report['tpot_slo']} s)")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["reference", "sglang"], default="sglang")
    p.add_argument(
        "--model", type=Path, default=None, help="a checkpoint (default: a 0.5B-shaped random one)"
    )
    p.add_argument("--gpus", default="0,1", help="GPUs of the SGLang replicas, round-robin")
    p.add_argument("--device", default="", help="the reference engine's --device (default: xavier up's)")
    p.add_argument("--setups", type=lambda v: v.split(","), default=["pd", "colocated"])
    p.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--lens", type=lambda v: tuple(int(x) for x in v.split("-")), default=(2000, 8000))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ttft-slo", type=float, default=0.5)
    p.add_argument("--tpot-slo", type=float, default=0.025)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--rounds", type=int, default=1, help="passes over the setups, alternating their order")
    p.add_argument("--sglang-arg", action="append", default=[], help="one more SGLang flag or value")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/goodput"))
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="xavier-goodput-"))
    if args.model is None:
        args.model = make_model(work / "qwen2.5-0.5b-shape")
    args.vocab = min(30000, int(json.loads((args.model / "config.json").read_text())["vocab_size"]))
    report: dict[str, Any] = {
        "engine": args.engine, "model": str(args.model), "gpus": args.gpus, "lens": list(args.lens),
        "max_tokens": args.max_tokens, "duration_s": args.duration, "ttft_slo": args.ttft_slo,
        "tpot_slo": args.tpot_slo, "attainment": args.attainment, "setups": {s: [] for s in args.setups},
    }  # fmt: skip
    for rnd in range(args.rounds):
        for setup in args.setups if rnd % 2 == 0 else args.setups[::-1]:
            proc, base = start(setup, args, work)
            try:
                points = []
                for i, rate in enumerate(args.rates):
                    points.append(asyncio.run(at_rate(base, rate, args, seed=1000 * rnd + 10 * i)))
                    print(
                        json.dumps({"setup": setup, "round": rnd + 1, **points[-1]}),
                        file=sys.stderr,
                        flush=True,
                    )
                report["setups"][setup].append(points)
            finally:
                stop(proc, grace=120)
    report["goodput_rps"] = {
        s: sorted(goodput(points, args.attainment) for points in rounds)
        for s, rounds in report["setups"].items()
    }
    if {"pd", "colocated"} <= set(report["goodput_rps"]):
        pd, co = (statistics.median(report["goodput_rps"][s]) for s in ("pd", "colocated"))
        report["pd_over_colocated"] = pd / co if co else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "setups"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
