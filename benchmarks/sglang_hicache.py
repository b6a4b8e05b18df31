"""SGLang HiCache on Xavier's page store against SGLang's own `file` L3 backend: a prefix one replica
computed, asked of another.

For each backend (`xavier`: `xavier up --engine sglang --mode colocated --unified 2 --sglang-hicache`, the
page store as SGLang's L3; `file`: the same mesh without a page store, SGLang's HiCache on its `file`
backend in a directory both replicas share) and each prefix length, per rep:

* `cold`: replica B, a prompt it never saw (prefix + 16 tokens): TTFT, and its greedy tokens;
* replica A computes another fresh prompt of the same length; once A's write-through reached the L3
  (the store's page count, or the files in the shared directory, stop growing), `warm`: the same prompt
  asked of B, which must find the prefix in the L3 (SGLang's cached-token count says how much) and answer
  the tokens A answered;
* `salted`: that prompt once more on B under a tenant salt no one used: SGLang must report nothing cached
  (another tenant's prefix is served neither from B's radix cache nor from the L3) and answer the same
  tokens, or the replica refuses salted requests by name where its release cannot isolate them.

On the Xavier store each warm rep also says where its time went (the backend's storage trace,
`XAVIER_SGLANG_TRACE`): the lookups' and gets' milliseconds, the time before the first storage call and
after the last one, and the gets' fetch steps (`get_read_ms`, ...).

TTFT is the client's, one GenerateUnified straight to the replica (max 1 token), from the send to the first
streamed message over a channel kept per replica, as a router calls (before "ttft_measure" was in the
JSON: to the stream's end, on a new channel per request). Medians of the reps; the
JSON has every rep. Replicas share the GPUs given round-robin (`--gpus 0,0`: both on GPU 0, started one
after another).

    python benchmarks/sglang_hicache.py --model /root/m05 --out docs/results/sglang-hicache-h200

Prints JSON; writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from sglang_pd import SGLANG_LAUNCHER, launch_up, make_model, stop

from tests.pagestore.engines import Answer, generate
from xavier_core.engine.tiny import QWEN25_05B, WIDTH_7B

SGLANG_ARGS = [
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3",
    "--cuda-graph-max-bs", "16", "--log-level", "warning",
    # SGLang sizes the host tier at twice the device pool by default (59 GB a replica here), and pinning it
    # takes minutes; the prefixes measured need well under 1 GB.
    "--hicache-size", "4",
]  # fmt: skip
NEW_TOKENS = 16
MODEL_SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "qwen2.5-7b": {**WIDTH_7B, "layers": 28}}
PAGE_TOKENS = 16
"""Tokens per KV page (`xavier up`'s SGLang page size)."""


def prompt(seed: int, n: int) -> list[int]:
    # Independent draws per seed: an arithmetic sequence mod 30,000 made every prompt a shifted copy of
    # one sequence, and a "cold" 8,000-token prompt found 2,000 of its tokens cached.
    rng = random.Random(seed)
    return [rng.randrange(10, 30010) for _ in range(n)]


class Mesh:
    """One `xavier up` of two unified SGLang replicas with HiCache on `backend`."""

    def __init__(self, backend: str, args: argparse.Namespace, work: Path) -> None:
        self.backend, self.work = backend, work / backend
        self.files = self.work / "hicache-files"
        flags = ["--sglang-hicache"] if backend == "xavier" else ["--no-pagestore", "--sglang-hicache-file"]
        if args.prefetch_policy:
            flags += [
                "--sglang-arg=--hicache-storage-prefetch-policy",
                f"--sglang-arg={args.prefetch_policy}",
            ]
        flags = ["--insecure", "--engine", "sglang", "--mode", "colocated", "--unified", "2",
                 "--model", str(args.model), "--gpus", args.gpus, "--sglang-command", SGLANG_LAUNCHER, *flags,
                 # Room for every prefix of the run: a full arena evicts, and the L3 would never grow
                 # by a whole prefix (the file backend keeps everything too).
                 "--pagestore-arena-bytes", str(args.store_arena_bytes),
                 *(f"--sglang-arg={a}" for a in SGLANG_ARGS + args.sglang_arg)]  # fmt: skip
        self.trace = self.work / "trace"
        env = {
            **os.environ,
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.files),
            "XAVIER_SGLANG_TRACE": str(self.trace),
        }
        self.proc, _ = launch_up(self.work, flags, env, timeout=1200)
        svc = self.work / "svc"
        self.a, self.b = (json.loads((svc / f"unified-{i}.ready").read_text())["address"] for i in (0, 1))
        store = svc / "pagestore.ready"
        self.store_metrics = json.loads(store.read_text())["metrics"] if store.exists() else ""

    def l3_size(self) -> float:
        """What the L3 holds now: the store's pages, or the bytes in the shared directory."""
        if self.backend == "file":
            return float(sum(f.stat().st_size for f in self.files.rglob("*") if f.is_file()))
        return self._store_metric("xavier_pagestore_pages")

    def store_hits(self) -> float:
        """Pages the store served (0 for the file backend, which keeps no count)."""
        return 0.0 if self.backend == "file" else self._store_metric("xavier_pagestore_hits_total")

    def _store_metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{self.store_metrics}/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        return sum(float(ln.split(" ")[1]) for ln in lines if ln.split(" ")[0] == name)

    def storage_calls(self, t0: float, t1: float) -> dict[str, float]:
        """Where a warm read's time went, from the Xavier backend's storage trace (`storage_call`): the
        lookups and gets that ran inside [t0, t1] (wall clock; only B is asked anything then)."""
        calls = []
        for f in self.trace.glob("hicache-*.jsonl"):
            calls += [json.loads(ln) for ln in f.read_text().splitlines() if ln]
        calls = [c for c in calls if t0 <= c["t0"] and c["t1"] <= t1]
        if not calls:
            return {}
        out = {"storage_calls": float(len(calls))}
        for op in ("exists", "get"):
            mine = [c for c in calls if c["op"] == op]
            out[f"{op}_ms"] = 1e3 * sum(c["t1"] - c["t0"] for c in mine)
        for c in calls:  # the gets' fetch steps (GetPages, READ, checksums...), summed
            for step, ms in c.get("steps_ms", {}).items():
                out[f"get_{step}_ms"] = out.get(f"get_{step}_ms", 0.0) + ms
        gets = [c for c in calls if c["op"] == "get"]
        out["gets_read_direct"] = float(sum(1 for c in gets if c.get("direct_reads", 0) > 0))
        out["gets_checked_natively"] = float(sum(1 for c in gets if c.get("native_checks")))
        out["to_first_call_ms"] = 1e3 * (min(c["t0"] for c in calls) - t0)
        out["after_last_call_ms"] = 1e3 * (t1 - max(c["t1"] for c in calls))
        return out

    def close(self) -> None:
        stop(self.proc, grace=120)


async def settled(mesh: Mesh, before: float, grow: float = 1.0, bound: float = 60.0) -> float:
    """Waits until the L3 grew by at least `grow` past `before` and then stayed put for a second;
    returns the size."""
    deadline = time.monotonic() + bound
    last, since = mesh.l3_size(), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        now = mesh.l3_size()
        if now != last:
            last, since = now, time.monotonic()
        elif last >= before + grow and time.monotonic() - since >= 1.0:
            return now
    raise RuntimeError(
        f"{mesh.backend}: a write-through never settled in the L3 ({before} -> {last}, {grow} wanted; "
        "a full store evicts: see --store-arena-bytes)"
    )


@dataclass(frozen=True)
class Replica:
    """A replica's address and the one channel kept to it, as a router holds them."""

    address: str
    channel: grpc.aio.Channel


async def timed(replica: Replica, ids: list[int], salt: str = "") -> tuple[float, Answer]:
    """TTFT (the send to the first streamed message) and the answer."""
    t = time.perf_counter()
    ans = await generate(replica.address, ids, salt, max_tokens=1, channel=replica.channel)
    return ans.first_at - t, ans


async def salted(replica: Replica, ids: list[int], salt: str) -> dict[str, Any]:
    """The warm prompt again under a tenant salt nobody used: it must find nothing cached (neither B's
    radix cache nor the L3 may serve another tenant's prefix) and answer what an unsalted run did; a
    release that cannot isolate by request refuses it (`salted_refused`, the status's code)."""
    try:
        _, ans = await timed(replica, ids, salt)
    except grpc.aio.AioRpcError as exc:
        return {"salted_refused": exc.code().name}
    return {"salted_cached_tokens": ans.usage.cached_tokens, "salted_tokens": ans.tokens}


async def measure(mesh: Mesh, args: argparse.Namespace) -> list[dict[str, Any]]:
    async with grpc.aio.insecure_channel(mesh.a) as ca, grpc.aio.insecure_channel(mesh.b) as cb:
        return await _measure(mesh, args, Replica(mesh.a, ca), Replica(mesh.b, cb))


async def _measure(mesh: Mesh, args: argparse.Namespace, a: Replica, b: Replica) -> list[dict[str, Any]]:
    await timed(a, prompt(10**5, 64))  # first-request costs out
    await timed(b, prompt(10**5 + 1, 64))
    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        try:
            rows.append(await _measure_length(mesh, args, a, b, length))
        except RuntimeError as exc:  # the rows so far and the other backend still count
            print(
                json.dumps({"backend": mesh.backend, "length": length, "failed": str(exc)}), file=sys.stderr
            )
            rows.append({"backend": mesh.backend, "prefix_tokens": length, "failed": str(exc)})
            break
    return rows


async def _measure_length(
    mesh: Mesh, args: argparse.Namespace, a: Replica, b: Replica, length: int
) -> dict[str, Any]:
    """One prefix length's reps on one mesh: cold on B, computed on A, then warm on B from the L3."""
    reps = []
    for rep in range(args.reps):
        seed = 1000 * length + 10 * rep
        before = mesh.l3_size()
        cold_s, cold = await timed(b, prompt(seed, length) + prompt(seed + 1, NEW_TOKENS))
        # B's own write-through of the cold prompt lands first: growth after this is A's alone.
        before = await settled(mesh, before)
        warm_ids = prompt(seed + 2, length) + prompt(seed + 3, NEW_TOKENS)
        _, on_a = await timed(a, warm_ids)
        # The store counts pages: every whole page of A's prefix must be there (the file backend's
        # byte count only has to grow).
        await settled(mesh, before, grow=length // PAGE_TOKENS if mesh.backend == "xavier" else 1.0)
        hits = mesh.store_hits()
        t0 = time.time()
        warm_s, warm = await timed(b, warm_ids)
        breakdown = mesh.storage_calls(t0, time.time())
        other = await salted(b, warm_ids, f"tenant-{seed}")
        if "salted_tokens" in other:
            other["salted_equals_a"] = other.pop("salted_tokens") == on_a.tokens
        reps.append({
            **breakdown,
            "cold_ms": 1e3 * cold_s, "warm_ms": 1e3 * warm_s,
            "cold_cached_tokens": cold.usage.cached_tokens,
            "warm_cached_tokens": warm.usage.cached_tokens,
            "store_pages_read": mesh.store_hits() - hits, "warm_equals_a": warm.tokens == on_a.tokens,
            **other,
        })  # fmt: skip
        print(
            json.dumps({"backend": mesh.backend, "length": length, **reps[-1]}),
            file=sys.stderr,
            flush=True,
        )
    cold_ms = statistics.median(r["cold_ms"] for r in reps)
    warm_ms = statistics.median(r["warm_ms"] for r in reps)
    return {
        "backend": mesh.backend, "prefix_tokens": length, "cold_ms": cold_ms, "warm_ms": warm_ms,
        "speedup": cold_ms / warm_ms,
        "warm_cached_tokens": statistics.median(r["warm_cached_tokens"] for r in reps),
        "outputs_equal": all(r["warm_equals_a"] for r in reps),
        # Another tenant's request of the same prompt: nothing cached for it, the same answer.
        "salt_isolated": all(r.get("salted_cached_tokens", 0) == 0 for r in reps),
        "salted_outputs_equal": all(r.get("salted_equals_a", True) for r in reps),
        "salted_refused": sorted({r["salted_refused"] for r in reps if "salted_refused" in r}),
        "reps": reps,
    }  # fmt: skip


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "warm_ms" in r]
    lengths = sorted({r["prefix_tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for i, (backend, case) in enumerate((b, c) for b in ("xavier", "file") for c in ("cold", "warm")):
        ys = [next((r[f"{case}_ms"] for r in rows if r["backend"] == backend and r["prefix_tokens"] == n), 0)
              for n in lengths]  # fmt: skip
        ax.bar([x + (i - 1.5) * width for x in range(len(lengths))], ys, width, label=f"{backend} {case}")
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT ms (median)")
    ax.set_title("SGLang HiCache: a prefix computed on replica A, asked of replica B")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=None, help="a checkpoint (default: a 0.5B-shaped random one)"
    )
    p.add_argument(
        "--shape",
        choices=sorted(MODEL_SHAPES),
        default="qwen2.5-0.5b",
        help="the random checkpoint's shape without --model (qwen2.5-7b: Qwen2.5-7B's, all 28 layers)",
    )
    p.add_argument("--backends", type=lambda v: v.split(","), default=["xavier", "file"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gpus", default="0,0")
    p.add_argument(
        "--prefetch-policy", default="", help="SGLang's --hicache-storage-prefetch-policy (default: its own)"
    )
    p.add_argument(
        "--sglang-arg", action="append", default=[], help="one more SGLang flag or value, repeatable"
    )
    p.add_argument(
        "--store-arena-bytes",
        type=int,
        default=4 << 30,
        help="the Xavier store's arena (default 4 GiB: every prefix of the run without eviction)",
    )
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sglang-hicache"))
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="xavier-hicache-"))
    args.model = make_model(args.model or work / f"{args.shape}-shape", MODEL_SHAPES[args.shape])
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        mesh = Mesh(backend, args, work)
        try:
            rows += asyncio.run(measure(mesh, args))
        finally:
            mesh.close()
    report = {
        "ttft_measure": "first message, kept channel",
        "model": str(args.model),
        "gpus": args.gpus,
        "new_tokens": NEW_TOKENS,
        "rows": rows,
    }
    for n in args.lengths:
        x = next((r for r in rows if r["backend"] == "xavier" and r["prefix_tokens"] == n), None)
        f = next((r for r in rows if r["backend"] == "file" and r["prefix_tokens"] == n), None)
        x, f = (r if r and "warm_ms" in r else None for r in (x, f))
        if x and f:
            report[f"xavier_warm_over_file_warm_{n}"] = f["warm_ms"] / x["warm_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
