"""Page store: get and put GB/s through NIXL against page count and local run length, with baselines.

Gets read the store by `--read-path`: `direct` (the client's default on the store's host: reads straight
out of the store process's memory, `xavier_core/pagestore/direct.py`), `nixl` (NIXL READs; the only path
before, and this benchmark's output with `--read-path nixl`), or both, one client each taking turns in
every rep, reported as one point per path (`read_path`; `get_nixl_gbps` / `get_nixl_ms` are then the
get's read step on that path).

Starts a real `xavier-pagestore` process and drives it with one `PageStoreClient` in this process, whose
pool is shaped like a KV pool (per layer a K and a V buffer). Local pages are placed in runs of
`--run-lengths` pages (runs apart from each other), so a run length of 1 is one NIXL descriptor per page
per buffer and longer runs coalesce. Each point is the median of `--reps`. Reported per point: end-to-end
put (`write`: reserve, checksum, WRITE, commit) and get (`lookup_and_fetch`: lease, READ, verify; the
release is not waited for) GB/s, where a get's time goes (GetPages RPC, NIXL READ, checksum pass, staging
copies), the NIXL descriptors each get and put posted (as the client counts them), the share of a get
spent verifying (and the get's GB/s without that pass), the NIXL transfer alone, and in-run baselines
on the same bytes: a numpy gather/scatter memcpy, the XXH3-128 checksum pass the store uses and the
BLAKE2b-128 pass it used before.

Then TTFT of a prompt with a `--prefix`-token shared prefix (the tiny CPU model, real processes: directory,
store, two unified replicas): cold (nothing cached anywhere), warm from the store (replica B, local cache
empty, fetches what replica A wrote through) and warm in B's local prefix cache, each TTFT from the send
to the first streamed message over a channel kept per replica (as a router calls); medians of
`--ttft-reps`, each rep with a fresh prefix and its own suffixes, where each case's replica spent its
time to the first token (`*_engine_phases_ms`: its `xavier_engine_first_token_seconds{phase}`; the rest
of the TTFT, `*_outside_engine_ms`, is the RPC and the servicer), the NIXL descriptors of B's store read (its
client's metric), where that read spent its time step by step (`warm_store_steps_ms`: B's
`xavier_pagestore_client_fetch_seconds{step}`; `--read-piece-bytes 0` reads each call in one READ, checked
after it, for a before/after in one session) and the prefill chunks each case's replica ran as decode
rows (`*_static_chunks`, its `xavier_engine_counts` metric: 1 when a warm suffix took the static-shape
path). Prints JSON, writes a PNG.
Example: `python benchmarks/pagestore.py --pages 16,64,256 --run-lengths 1,4,64 --reps 3 --ttft-reps 7`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.procs import start_service
from xavier_core.engine.timing import PHASES
from xavier_core.pagestore import PageNamespace, PageStoreClient
from xavier_core.pagestore import client as client_module
from xavier_core.pagestore import staging as staging_module
from xavier_core.pagestore.layout import local_page_checksums
from xavier_core.pagestore.metrics import FETCH_STEPS, client_metrics
from xavier_core.pagestore.nixl import TCP_SEGMENT_BYTES
from xavier_core.pagestore.reading import PART_BYTES, PIECE_BYTES, read_checked_in_parts
from xavier_core.transfer.common.buffers import KvBuffer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--segment-bytes", type=int, default=4096, help="bytes of one page of one buffer")
    p.add_argument("--pages", default="16,64,256")
    p.add_argument("--run-lengths", default="1,4,64")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--model-cache",
        type=Path,
        default=None,
        help="keep the random checkpoint under this folder and reuse it in later runs of the same shape",
    )
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--tag", default="")
    p.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens of the TTFT prompts")
    p.add_argument("--ttft-reps", type=int, default=7, help="TTFT samples per case (0: skip TTFT)")
    p.add_argument("--skip-gbps", action="store_true", help="only the TTFT part")
    p.add_argument("--device", default="cpu", help="where the TTFT replicas keep KV and compute (cpu, cuda)")
    p.add_argument(
        "--pool-device", default="cpu", help="where the GB/s part's local pool lives (cpu, cuda:0)"
    )
    p.add_argument(
        "--store-chunk-bytes",
        type=int,
        default=16 << 20,
        help="the TTFT store's arena chunk (the store's default); a stored run never crosses a chunk",
    )
    p.add_argument(
        "--compile-static",
        action="store_true",
        help="the TTFT replicas compile their static-shape step (engine.compile, CUDA only): a prefix "
        "hit's suffix replays a graph of fused kernels",
    )
    p.add_argument(
        "--share-prefixes",
        action="store_true",
        help="the TTFT replicas share the prefixes they hold (handoff.share_prefixes): B copies the "
        "pages A wrote from A's pool instead of READing the store",
    )
    p.add_argument(
        "--standing-seconds",
        type=float,
        default=None,
        help="with --share-prefixes, how long A's written pages stand in its pool for B to copy without "
        "asking (handoff.standing_share_seconds; default the service's; 0: B asks A each time)",
    )
    p.add_argument(
        "--read-piece-bytes",
        type=int,
        default=0,
        help=f"a fetch READs in pieces of about this many bytes (say {PIECE_BYTES}), each checked while the "
        "next moves (0, the store client's default: one READ per store call)",
    )
    p.add_argument(
        "--read-path",
        default="direct,nixl",
        help="how the GB/s part's gets read the store (same host): direct (out of its memory, the "
        "client's default), nixl (NIXL READs: this benchmark before --read-path), or both (one client "
        "each, taking turns in every rep); the TTFT replicas read by the first",
    )
    p.add_argument(
        "--read-then-check",
        action="store_true",
        help="same-host reads land whole and are checked after (pagestore.check_while_reading false), "
        "not checked page by page as they land: the baseline of the one-pass read",
    )
    p.add_argument(
        "--checked-part-bytes",
        type=int,
        default=None,
        help="a same-host read checked as it lands into a GPU pool (or a staged host pool) is made in parts "
        f"of about this many bytes, each part's rows crossing while the next is read (default the client's, "
        f"0: one part, crossing once it has all landed; {PART_BYTES} is the size `cases.sh partab` sets)",
    )
    p.add_argument(
        "--stage-host-pool",
        action="store_true",
        help="the GB/s client and the TTFT replicas pass their host pool through the mirror a GPU pool takes",
    )
    p.add_argument(
        "--shape",
        choices=["tiny", "qwen2.5-0.5b", "7b-width"],
        default="tiny",
        help="TTFT model shape (random weights; 7b-width: Qwen2.5-7B's width at 4 layers, use --prefix 8000)",
    )
    p.add_argument(
        "--shape-layers",
        type=int,
        default=0,
        help="layers of the TTFT model instead of the shape's own (28 with 7b-width: Qwen2.5-7B's depth)",
    )
    return p.parse_args(argv)


def fetch_steps() -> dict[str, float]:
    """Seconds this process's page store clients spent per fetch step so far (their metric)."""
    counter = client_metrics().fetch_seconds
    return {step: counter.labels(step)._value.get() for step in FETCH_STEPS}


def placement(count: int, run: int) -> list[int]:
    """`count` local pages in runs of `run`, each run followed by a gap of `run` pages."""
    return [2 * (i // run) * run + i % run for i in range(count)]


def keys_for(prompt: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(prompt)
    return [rng.bytes(32) for _ in range(count)]


def memcpy_baseline(pool: list[np.ndarray], pages: list[int], seg: int, reps: int) -> float:
    views = [a.reshape(-1, seg) for a in pool]
    dst = [np.empty((len(pages), seg), np.uint8) for _ in pool]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for v, d in zip(views, dst, strict=True):
            np.take(v, pages, axis=0, out=d)  # gather ...
            v[pages] = d  # ... and scatter back: the same two copies a put + get make
        times.append((time.perf_counter() - t) / 2)
    return statistics.median(times)


def unchecked_verifier(client: PageStoreClient) -> Any:
    """A stand-in for `client._verifier` that takes a get's pages as they land, unchecked (through a
    mirror, still copied to the pool): the baseline that says what verification adds to a get."""

    def unchecked(local: list[int], dest: list[int], sums: list[bytes]) -> Any:
        def verify(lo: int, hi: int, clock: Any) -> list[int]:
            if client.staging is not None:
                with clock.step("stage_copy"):
                    client.staging.to_pool(local[lo:hi], dest[lo:hi])
            return []

        return verify

    return unchecked


def unhashed_read(client: PageStoreClient) -> Any:
    """A stand-in for `client._read_checked` (a same-host read, each page checked as it lands, into a
    host pool or a GPU pool's staging rows): the same read by the same page loop with the hashing left
    out (`DirectArena.read_unhashed`), timed as the `read` step, the rows still moved to the pool, in the
    same parts (each part's rows moving while the next is read). What checking as they land adds to a get
    is told against it."""

    def read(
        store: Any,
        spans: Any,
        pages: list[int],
        sums: list[bytes],
        clock: Any,
        slots: Any = (),
        made: list[tuple[int, int]] | None = None,
    ) -> list[int]:
        rows = client._landing_rows(spans, pages, slots)
        parts = client._checked_parts(len(pages))
        if made is not None:
            made += parts
        if client.staging is not None and len(parts) > 1:
            unhashed: Any = UnhashedReads(clock)
            none = [b""] * len(pages)  # what `unhashed` answers for each page: all pass
            return read_checked_in_parts(
                unhashed, store, rows, none, client.staging, slots, pages, parts, clock
            )
        with clock.step("read"):
            store.arena.read_unhashed(rows)
        client._landed(slots, pages, clock)
        return []

    return read


@dataclasses.dataclass
class UnhashedReads:
    """A connection stand-in for `read_checked_in_parts` whose `read_checked` reads a part unhashed (timed
    as the `read` step, within the part's `read_checked`) and answers an empty sum for each page."""

    clock: Any

    def read_checked(self, store: Any, rows: Any) -> list[bytes]:
        with self.clock.step("read"):
            store.arena.read_unhashed(rows)
        return [b""] * rows.shape[0]


async def unchecked_get(
    client: PageStoreClient, ns: PageNamespace, keys: list[bytes], pages: list[int], count: int
) -> None:
    """A get of `keys` into `pages` with its hash left out: through `unchecked_verifier` where the pages
    are read first and checked after (a GPU pool's same-host read read first lands page-major in the
    staging rows, `HostStaging.check_rows`: the rows still copied to the device), through
    `unhashed_read` where they are checked as they land."""
    hashing = {name: getattr(staging_module, name) for name in ("page_row_checksums", "failed_pages")}
    real, real_read = client._verifier, client._read_checked
    client._verifier = unchecked_verifier(client)  # type: ignore[method-assign]
    client._read_checked = unhashed_read(client)  # type: ignore[method-assign]
    setattr(staging_module, "page_row_checksums", lambda rows: [])  # noqa: B010
    setattr(staging_module, "failed_pages", lambda got, want, first=0: [])  # noqa: B010
    try:
        if await client.lookup_and_fetch(ns, keys, pages) != count:
            raise RuntimeError("get did not hit every page")
    finally:
        client._verifier, client._read_checked = real, real_read  # type: ignore[method-assign]
        for name, fn in hashing.items():
            setattr(staging_module, name, fn)


@dataclasses.dataclass
class Probe:
    """One client reading by one path (`--read-path`), with the timers wrapped around it."""

    path: str
    client: PageStoreClient
    nixl_times: list[float] = dataclasses.field(default_factory=list)  # each NIXL WRITE alone
    stage_times: list[float] = dataclasses.field(default_factory=list)  # each mirror copy


def probe(address: str, bufs: list[KvBuffer], path: str, args: argparse.Namespace, pages: int) -> Probe:
    """A client whose gets take `path` (direct: out of the store's memory; nixl: NIXL READs)."""
    settings = client_module.ClientSettings(
        rpc_timeout_s=30,
        transfer_timeout_s=60,
        staging_pages=pages,
        stage_host_pool=args.stage_host_pool,
        read_piece_bytes=args.read_piece_bytes,
        same_host_reads=path == "direct",
        checked_read_part_bytes=part_bytes(args),
    )
    out = Probe(path, PageStoreClient(address, bufs, settings))
    real_move = out.client.conn.move

    def timed_move(*a: Any) -> None:  # the NIXL transfer alone (a worker thread)
        t = time.perf_counter()
        real_move(*a)
        out.nixl_times.append(time.perf_counter() - t)

    out.client.conn.move = timed_move  # type: ignore[method-assign,assignment]
    if out.client.staging is not None:
        staging = out.client.staging
        real_copy = staging._copy

        def timed_copy(*a: Any, **kw: Any) -> None:
            t = time.perf_counter()
            real_copy(*a, **kw)
            out.stage_times.append(time.perf_counter() - t)

        staging._copy = timed_copy  # type: ignore[method-assign]
    return out


async def one_rep(
    p: Probe, prompt: int, pages: list[int], count: int, checked_first: bool, got: dict[str, list[float]]
) -> None:
    """A put of `count` fresh pages, then their get with and without its checks (in the order given),
    each sample appended to `got` under its name."""
    client = p.client
    ns = PageNamespace("bench", str(prompt))
    keys = keys_for(prompt, count)
    p.nixl_times.clear()
    p.stage_times.clear()
    before = dataclasses.replace(client.counters)
    t = time.perf_counter()
    if await client.write(ns, keys, pages) != count:
        raise RuntimeError("put did not commit every page")
    got["put_t"].append(time.perf_counter() - t)
    got["put_d"].append(client.counters.write_descriptors - before.write_descriptors)
    got["put_x"].append(p.nixl_times[-1])
    got["put_s"].append(sum(p.stage_times))
    # The same get without its checks, in the same rep, the two in alternating order: what verification
    # adds to a get is the difference of the two.
    for checked in (True, False) if checked_first else (False, True):
        if not checked:
            t = time.perf_counter()
            await unchecked_get(client, ns, keys, pages, count)
            got["get_u"].append(time.perf_counter() - t)
            await client.flush()
            continue
        steps = fetch_steps()
        before = dataclasses.replace(client.counters)  # after the unchecked get, when that went first
        t = time.perf_counter()
        if await client.lookup_and_fetch(ns, keys, pages) != count:
            raise RuntimeError("get did not hit every page")
        got["get_t"].append(time.perf_counter() - t)
        got["get_d"].append(client.counters.read_descriptors - before.read_descriptors)
        got["get_m"].append(client.counters.direct_reads - before.direct_reads)
        spent = {k: v - steps[k] for k, v in fetch_steps().items()}
        # The client's own clock (`xavier_pagestore_client_fetch_seconds{step}`): with the READ in
        # pieces, the checks of landed pieces overlap the READ of the next.
        # Read and checked as they land (`read_checked`): the two in one step, the check not apart.
        got["get_x"].append(spent["read"] + spent["read_checked"])
        got["get_s"].append(spent["stage_copy"])
        got["get_r"].append(spent["get_pages"])
        got["get_c"].append(spent["verify"])
        await client.flush()  # the lease release the get did not wait for


def part_bytes(args: argparse.Namespace) -> int:
    """`--checked-part-bytes`, else the client's default (`ClientSettings.checked_read_part_bytes`)."""
    default = client_module.ClientSettings().checked_read_part_bytes
    return default if args.checked_part_bytes is None else int(args.checked_part_bytes)


def read_paths(args: argparse.Namespace) -> list[str]:
    paths = [x.strip() for x in args.read_path.split(",") if x.strip()]
    if not paths or any(x not in ("direct", "nixl") for x in paths) or len(set(paths)) != len(paths):
        raise SystemExit(f"--read-path takes direct, nixl or both, got {args.read_path!r}")
    return paths


async def run(args: argparse.Namespace, address: str) -> dict[str, Any]:
    seg = args.segment_bytes
    counts = [int(x) for x in args.pages.split(",")]
    runs = [int(x) for x in args.run_lengths.split(",")]
    paths = read_paths(args)
    pool_pages = 2 * max(counts) + max(runs)
    rng = np.random.default_rng(args.seed)
    pool = [rng.integers(0, 256, pool_pages * seg, dtype=np.uint8) for _ in range(2 * args.layers)]
    host_bufs = [KvBuffer(a.ctypes.data, a.nbytes, seg, "cpu") for a in pool]
    bufs, keep = host_bufs, []
    if args.pool_device != "cpu":  # the pool on the GPU: the client goes through its pinned host mirror
        import torch

        keep = [torch.from_numpy(a).to(args.pool_device) for a in pool]
        bufs = [KvBuffer(t.data_ptr(), t.numel(), seg, str(t.device)) for t in keep]
    probes = [probe(address, bufs, path, args, max(counts)) for path in paths]
    page_bytes = seg * len(bufs)
    points = []
    prompt = 0
    try:
        for count in counts:
            for run_len in runs:
                if run_len > count:
                    continue
                pages = placement(count, run_len)
                got: dict[str, dict[str, list[float]]] = {p.path: defaultdict(list) for p in probes}
                for rep in range(args.reps):
                    # The paths take turns going first, as the checked and unchecked gets do.
                    for p in probes if rep % 2 == 0 else probes[::-1]:
                        prompt += 1
                        await one_rep(
                            p, prompt, pages, count, len(got[p.path]["get_t"]) % 2 == 0, got[p.path]
                        )
                nbytes = count * page_bytes
                t = time.perf_counter()
                local_page_checksums(host_bufs, pages)
                checksum_s = time.perf_counter() - t
                blake2b_s = blake2b_baseline(host_bufs, pages)
                memcpy_s = memcpy_baseline(pool, pages, seg, args.reps)
                for p in probes:
                    points.append(point(got[p.path], p.path, count, run_len, nbytes))
                    points[-1]["memcpy_gbps"] = nbytes / memcpy_s / 1e9
                    points[-1]["checksum_gbps"] = nbytes / checksum_s / 1e9
                    points[-1]["blake2b_gbps"] = nbytes / blake2b_s / 1e9
                    points[-1]["checksum_ms"] = 1e3 * checksum_s
                    print(json.dumps(points[-1]), file=sys.stderr)
        await probes[0].client.flush()
        stats = await probes[0].client.stats()
    finally:
        for p in probes:
            await p.client.close()
    return {
        "benchmark": "pagestore",
        "segments": len(bufs),
        "segment_bytes": seg,
        "page_bytes": page_bytes,
        "reps": args.reps,
        "read_paths": paths,
        "store_leases_after": stats.leases,
        "points": points,
    }


def point(got: dict[str, list[float]], path: str, count: int, run_len: int, nbytes: int) -> dict[str, Any]:
    """One point's medians for one read path."""

    def gbps(seconds: list[float], n: int = nbytes) -> float:
        return n / statistics.median(seconds) / 1e9

    def ms(name: str) -> float:
        return 1e3 * statistics.median(got[name])

    return {
        "pages": count,
        "run_length": run_len,
        "read_path": path,
        "bytes": nbytes,
        # Counted by the client (what it posted), not computed: the local runs times the store's runs,
        # per segment.
        "descriptors": statistics.median(got["get_d"]),
        "put_descriptors": statistics.median(got["put_d"]),
        # The get's READs straight out of the store's memory (its client's counter): 0 over NIXL.
        "direct_reads": statistics.median(got["get_m"]),
        "put_gbps": gbps(got["put_t"]),
        "get_gbps": gbps(got["get_t"]),
        "put_nixl_gbps": gbps(got["put_x"]),
        # The get's "read" step alone: NIXL READs, or the reads straight out of the store's memory.
        "get_nixl_gbps": gbps(got["get_x"]),
        # The checksum pass's own time over a get's (pieces checked while the next moves count in
        # full) ...
        "get_verify_share": statistics.median(got["get_c"]) / statistics.median(got["get_t"]),
        # ... and what it adds: the same gets with and without their checks, same run.
        "get_verify_added_share": 1 - statistics.median(got["get_u"]) / statistics.median(got["get_t"]),
        "get_unverified_gbps": gbps(got["get_u"]),
        "get_unverified_ms": ms("get_u"),
        "put_ms": ms("put_t"),
        "get_ms": ms("get_t"),
        "put_staging_ms": ms("put_s"),
        "get_staging_ms": ms("get_s"),
        # Where a get's time goes: the GetPages RPC, the READ (NIXL or direct), the checksum pass.
        "get_rpc_ms": ms("get_r"),
        "get_nixl_ms": ms("get_x"),
        "get_checksum_ms": ms("get_c"),
        # Per rep, for a reader who wants the spread: end-to-end get and its read step.
        "get_ms_per_rep": [1e3 * x for x in got["get_t"]],
        "get_read_ms_per_rep": [1e3 * x for x in got["get_x"]],
    }


async def ttft_cases(mesh: Any, args: argparse.Namespace) -> dict[str, Any]:
    """TTFT (client side, GenerateUnified to its first token) of cold / warm-from-store / warm-local."""
    from tests.pagestore.engines import generate, prompt, wait_for
    from tests.pagestore.support import stats
    from xavier_core.engine import tiny

    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    cases: dict[str, list[float]] = {"cold": [], "warm_store": [], "warm_local": []}
    read_descriptors: list[float] = []
    holder: list[float] = []
    steps: list[dict[str, float]] = []  # B's fetch steps in each warm-from-store request (its metric)
    served: list[dict[str, float]] = []  # the store's GetPages and A's SharePrefix handling in each
    metrics_b = mesh.procs["unified-b"].metrics
    metrics = {a: mesh.procs["unified-a"].metrics, b: metrics_b}
    cached: dict[str, list[int]] = {k: [] for k in cases}
    static: dict[str, list[float]] = {k: [] for k in cases}
    lone: dict[str, list[float]] = {k: [] for k in cases}  # of `static`, chunks alone in their step
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in cases}  # the engine's, per request
    lifetimes: dict[str, list[float]] = {k: [] for k in cases}  # send to the stream's end
    # One channel per replica, as a router holds them; TTFT is the client's send to the first message.
    channels = {x: grpc.aio.insecure_channel(x) for x in (a, b)}
    # First-request costs out, B's warm path's too: B's first prompt starts with A's, which B fetches (its
    # first store read, or its first copy from A's pool: the copy kernel's compile, the pool's mapping).
    await generate(a, prompt(10**6, 64), max_tokens=1, channel=channels[a])
    await wait_for(lambda: stats(mesh.store.address).pages >= 64 // 16, 30, "A's warm-up write-through")
    await generate(b, prompt(10**6, 64) + prompt(10**6 + 1, 16), max_tokens=1, channel=channels[b])
    for rep in range(args.ttft_reps):
        shared = prompt(1000 + rep, args.prefix)
        for case, addr, suffix in (("cold", a, 1), ("warm_store", b, 2), ("warm_local", b, 3)):
            posted = scrape(metrics_b, READ_DESCRIPTORS)
            copied = scrape(metrics_b, HOLDER_READS)
            chunks = scrape(metrics[addr], STATIC_CHUNKS)
            alone = scrape(metrics[addr], STATIC_SHARED)
            spent = scrape_steps(metrics_b)
            handled = scrape_handling(mesh.store.metrics, metrics[a])
            phased = scrape_phases(metrics[addr])
            t = time.perf_counter()
            ans = await generate(
                addr, shared + prompt(7000 + 10 * rep + suffix, 16), max_tokens=1, channel=channels[addr]
            )
            cases[case].append(ans.first_at - t)
            lifetimes[case].append(time.perf_counter() - t)
            phases[case].append({k: v - phased[k] for k, v in scrape_phases(metrics[addr]).items()})
            static[case].append(scrape(metrics[addr], STATIC_CHUNKS) - chunks)
            lone[case].append(scrape(metrics[addr], STATIC_SHARED) - alone)
            if case == "warm_store":
                holder.append(scrape(metrics_b, HOLDER_READS) - copied)
                read_descriptors.append(scrape(metrics_b, READ_DESCRIPTORS) - posted)
                steps.append({k: v - spent[k] for k, v in scrape_steps(metrics_b).items()})
                served.append(
                    {k: v - handled[k] for k, v in scrape_handling(mesh.store.metrics, metrics[a]).items()}
                )
            cached[case].append(
                ans.usage.cached_tokens_store if case == "warm_store" else ans.usage.cached_tokens
            )
            if case == "cold":  # A's write-through is asynchronous: B asks only once it has landed
                deadline = time.monotonic() + 30
                while stats(mesh.store.address).pages < (rep + 1) * (args.prefix // 16) + 64 // 16:
                    if time.monotonic() > deadline:
                        raise RuntimeError("A's write-through never reached the store")
                    await asyncio.sleep(0.01)
    for ch in channels.values():
        await ch.close()
    out: dict[str, Any] = {
        # Since this key exists: the client's send to the first streamed message, over a channel kept
        # per replica (before: to the end of the stream, on a new channel per request; "*_lifetime_ms"
        # now).
        "ttft_measure": "first message, kept channel",
        # A health check's round trip from this process (median of 20): this host's floor for the fetch's
        # GetPages (to the store) and for a request's path outside the engine (to B).
        "bare_rpc_ms_store": await bare_rpc_ms(mesh.store.address),
        "bare_rpc_ms_replica": await bare_rpc_ms(b),
        "prefix_tokens": args.prefix,
        "shape": args.shape,
        "shape_layers": tiny.shape_sizes(args.shape, args.shape_layers).get("layers", 2),
        "device": args.device,
        "prompt_tokens": args.prefix + 16,
        "reps": args.ttft_reps,
        "store_chunk_bytes": args.store_chunk_bytes,
        "staged": args.stage_host_pool or args.device != "cpu",
        # NIXL descriptors of the warm-from-store fetch, as B's client counted them (its metric).
        "warm_store_read_descriptors": statistics.median(read_descriptors),
        "warm_store_read_descriptors_per_rep": read_descriptors,
        "read_piece_bytes": args.read_piece_bytes,
        "check_while_reading": not args.read_then_check,
        # Parts of a read checked as it lands into a GPU pool (0: one part).
        "checked_read_part_bytes": part_bytes(args),
        "read_path": read_paths(args)[0],
        "share_prefixes": args.share_prefixes,
        "compile_static": args.compile_static,
        "standing_share_seconds": args.standing_seconds,
        # Store calls of B's warm fetches served by copying from A's pool (its client's reads{path=holder}).
        "warm_store_holder_copies": sum(holder),
        # Where B's fetch of the stored prefix spent its time, per step (medians over the reps, ms):
        # get_pages (lookup + lease, one RPC), read (NIXL, first post to last done), verify (checksums),
        # stage_copy (mirror <-> pool), worker (the thread hop), fetch (all of it, end to end). With the
        # READ in pieces, verify and stage_copy overlap read, so the steps sum to more than fetch; a read
        # checked as it lands in parts keeps them apart (stage_copy: each part's DMAs queued, then the
        # scatter and the wait for what is still moving).
        "warm_store_steps_ms": {k: 1e3 * statistics.median(r[k] for r in steps) for k in FETCH_STEPS},
        "warm_store_steps_ms_per_rep": [{k: 1e3 * v for k, v in r.items()} for r in steps],
        # Of the fetch's two calls, the time their servers spent handling them (xavier_rpc_seconds): the
        # store's GetPages and A's SharePrefix (0 when the fetch READ the store); the rest of steps
        # get_pages and holder_ask is the calls' way there and back.
        "warm_store_handling_ms": {k: 1e3 * statistics.median(r[k] for r in served) for k in HANDLED},
        # The rest of a warm-from-store TTFT: the RPC, admission, scheduling and the suffix's compute,
        # the same work as a local hit's whole TTFT.
        "warm_store_outside_fetch_ms": 1e3
        * statistics.median(t - r["fetch"] for t, r in zip(cases["warm_store"], steps, strict=True)),
    }
    for case, times in cases.items():
        out[f"{case}_ms"] = 1e3 * statistics.median(times)
        out[f"{case}_min_ms"] = 1e3 * min(times)
        out[f"{case}_cached_tokens"] = statistics.median(cached[case])
        # Prefill chunks the replica ran as decode rows (static shapes, CUDA graphs) for this prompt.
        out[f"{case}_static_chunks"] = statistics.median(static[case])
        # Of them, chunks alone in their step: rows sharing one page table (the context gathered once).
        out[f"{case}_static_shared_chunks"] = statistics.median(lone[case])
        # Where the replica's engine spent the request's time to its first token (medians per phase,
        # ms; see xavier_core/engine/timing.py), and the rest of the client's TTFT: the RPC both ways,
        # the servicer, and the response's way back.
        out[f"{case}_engine_phases_ms"] = {
            ph: 1e3 * statistics.median(r[ph] for r in phases[case]) for ph in PHASES
        }
        out[f"{case}_outside_engine_ms"] = 1e3 * statistics.median(
            t - r["total"] for t, r in zip(times, phases[case], strict=True)
        )
        # To the stream's end (its status), what TTFT meant before "ttft_measure".
        out[f"{case}_lifetime_ms"] = 1e3 * statistics.median(lifetimes[case])
    # What a store hit adds over a local hit, paired per rep (the same prefix): less noisy than the
    # difference of the two medians on a shared machine.
    extra = [s - loc for s, loc in zip(cases["warm_store"], cases["warm_local"], strict=True)]
    out["store_over_local_ms"] = 1e3 * statistics.median(extra)
    out["speedup_store"] = out["cold_ms"] / out["warm_store_ms"]
    out["speedup_local"] = out["cold_ms"] / out["warm_local_ms"]
    return out


async def bare_rpc_ms(address: str) -> float:
    """Median round trip (ms) of 20 health checks to `address` on one channel, after one to connect."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def run_ttft(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tests.pagestore.engines import StoreMesh
    from xavier_core.engine.tiny import make_tiny, shape_sizes

    sizes = shape_sizes(args.shape, args.shape_layers)
    dtype = "float16" if args.device != "cpu" else "float32"
    name = f"{args.shape}-qwen2" + (f"-{args.shape_layers}l-{dtype}-{args.seed}" if args.model_cache else "")
    model = (args.model_cache or work) / name
    if not (model / "model.safetensors").exists():  # a cached checkpoint is written last
        make_tiny(model, "qwen2", seed=args.seed, dtype=dtype, **sizes)
    # Room in the store for every rep's prefix (no eviction between A's write and B's read).
    geometry = {"layers": 2, "kv_heads": 2, "heads": 4, "hidden": 64, **sizes}
    per_token = 2 * geometry["layers"] * geometry["kv_heads"] * (geometry["hidden"] // geometry["heads"]) * 4
    arena = max(32 << 20, 2 * (args.ttft_reps + 2) * (args.prefix + 64) * per_token)
    # A pool where every rep's prefix still stands within the default quarter of it
    # (handoff.standing_share_pool_fraction): A writes one per rep, and each stands 10 s.
    env = {"XAVIER_ENGINE__NUM_PAGES": str(max(600, 4 * (args.ttft_reps + 2) * (args.prefix // 16 + 8)))}
    if args.stage_host_pool:
        env["XAVIER_PAGESTORE__STAGE_HOST_POOL"] = "true"
    env["XAVIER_PAGESTORE__READ_PIECE_BYTES"] = str(args.read_piece_bytes)
    env["XAVIER_PAGESTORE__SAME_HOST_READS"] = str(read_paths(args)[0] == "direct").lower()
    env["XAVIER_PAGESTORE__CHECK_WHILE_READING"] = str(not args.read_then_check).lower()
    env["XAVIER_PAGESTORE__CHECKED_READ_PART_BYTES"] = str(part_bytes(args))
    env["XAVIER_HANDOFF__SHARE_PREFIXES"] = str(args.share_prefixes).lower()
    env["XAVIER_ENGINE__COMPILE"] = str(args.compile_static).lower()
    if args.standing_seconds is not None:
        env["XAVIER_HANDOFF__STANDING_SHARE_SECONDS"] = str(args.standing_seconds)
    arena = -(-arena // args.store_chunk_bytes) * args.store_chunk_bytes
    mesh = StoreMesh(model, work, device=args.device, arena=arena, chunk=args.store_chunk_bytes, env=env)
    try:
        mesh.start_directory()
        mesh.start_store()
        for name in ("unified-a", "unified-b"):
            mesh.start_unified(name, "--pagestore", mesh.store.address)
        return asyncio.run(ttft_cases(mesh, args))
    finally:
        mesh.stop()


READ_DESCRIPTORS = 'xavier_pagestore_client_transfer_descriptors_total{op="read"}'
HOLDER_READS = 'xavier_pagestore_client_reads_total{path="holder"}'
STATIC_CHUNKS = 'xavier_engine_counts{name="static_prefill_chunks",role="unified"}'
STATIC_SHARED = 'xavier_engine_counts{name="static_shared_chunks",role="unified"}'


def scrape(metrics: str, sample: str) -> float:
    """One sample of a service's Prometheus text (0 while the counter has no sample yet)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


FETCH_SECONDS = "xavier_pagestore_client_fetch_seconds_total"
HANDLED = {
    "get_pages": 'xavier_rpc_seconds_sum{method="GetPages",service="xavier.v1.PageStoreService"}',
    "share_prefix": 'xavier_rpc_seconds_sum{method="SharePrefix",service="xavier.v1.DecodeService"}',
}
"""The fetch's calls whose handling the benchmark reads off their servers (the store's, the holder's), by
the step they sit in."""


def scrape_handling(store_metrics: str, holder_metrics: str) -> dict[str, float]:
    """Seconds the store spent handling GetPages and the holder SharePrefix so far (`HANDLED`)."""
    return {
        step: scrape(store_metrics if step == "get_pages" else holder_metrics, sample)
        for step, sample in HANDLED.items()
    }


def scrape_steps(metrics: str) -> dict[str, float]:
    """A replica's page store fetch seconds so far, per step (`FETCH_STEPS`)."""
    return {step: scrape(metrics, f'{FETCH_SECONDS}{{step="{step}"}}') for step in FETCH_STEPS}


FIRST_TOKEN_SECONDS = "xavier_engine_first_token_seconds_total"


def scrape_phases(metrics: str) -> dict[str, float]:
    """A replica's engine first-token seconds so far, per phase (`xavier_core.engine.timing.PHASES`)."""
    return {ph: scrape(metrics, f'{FIRST_TOKEN_SECONDS}{{phase="{ph}"}}') for ph in PHASES}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft = report.get("ttft")
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    if ttft:
        names = ["cold", "warm_store", "warm_local"]
        bars = axes[2].bar(["cold", "warm from store", "warm local cache"], [ttft[f"{n}_ms"] for n in names])
        axes[2].bar_label(bars, fmt="%.1f ms")
        axes[2].set_ylabel("TTFT, median (ms)")
        axes[2].set_title(
            f"TTFT, {ttft['prefix_tokens']}-token shared prefix ({ttft['shape']}, {ttft['device']})"
        )
    else:
        axes[2].set_axis_off()
    runs = sorted({p["run_length"] for p in report["points"]})
    if not runs:  # --skip-gbps
        for ax in axes[:2]:
            ax.set_axis_off()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    paths = report.get("read_paths", ["nixl"])
    for ax, op in zip(axes[:2], ("get", "put"), strict=True):
        for way in paths if op == "get" else paths[:1]:
            for r in runs:
                pts = [p for p in report["points"] if p["run_length"] == r and p.get("read_path", way) == way]
                x = [p["pages"] for p in pts]
                via = f", {way}" if op == "get" and len(paths) > 1 else ""
                read = "read" if way == "direct" and op == "get" else f"NIXL {op}"
                ax.plot(x, [p[f"{op}_gbps"] for p in pts], "o-", label=f"{op}, runs of {r}{via}")
                ax.plot(x, [p[f"{op}_nixl_gbps"] for p in pts], "x--", label=f"{read} only, runs of {r}{via}")
        base = [p for p in report["points"] if p["run_length"] == runs[-1]] or report["points"]
        ax.plot([p["pages"] for p in base], [p["memcpy_gbps"] for p in base], "k:", label="local memcpy")
        ax.plot([p["pages"] for p in base], [p["checksum_gbps"] for p in base], "k-.", label="XXH3-128 pass")
        ax.plot([p["pages"] for p in base], [p["blake2b_gbps"] for p in base], "k--", label="BLAKE2b pass")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"pages ({report['page_bytes'] // 1024} KiB each)")
        ax.set_title(f"page store {op}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s")
    axes[1].sharey(axes[0])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def blake2b_baseline(buffers: list[Any], pages: list[int]) -> float:
    """Seconds of the BLAKE2b-128 pass the store used before XXH3-128, over the same page bytes."""
    import hashlib

    from xavier_core.pagestore.layout import buffer_view

    views = [(buffer_view(b.addr, b.nbytes), b.bytes_per_page) for b in buffers]
    t = time.perf_counter()
    for page in pages:
        h = hashlib.blake2b(digest_size=16)
        for view, size in views:
            h.update(view[page * size : (page + 1) * size])
        h.digest()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(x) for x in args.pages.split(",")]
    page_bytes = args.segment_bytes * 2 * args.layers
    arena = (
        sum(counts) * len(args.run_lengths.split(",")) * args.reps * len(read_paths(args)) + 64
    ) * page_bytes
    chunk = max(16 << 20, page_bytes)
    report: dict[str, Any] = {"benchmark": "pagestore", "points": []}
    with tempfile.TemporaryDirectory() as work:
        env = {
            "XAVIER_PAGESTORE__ARENA_BYTES": str(max(arena, chunk)),
            "XAVIER_PAGESTORE__CHUNK_BYTES": str(chunk),
            "XAVIER_PAGESTORE__MAX_LEASE_SECONDS": "600",
            "XAVIER_LOG_LEVEL": "warning",
        }
        if not args.skip_gbps:
            svc = start_service("xavier-pagestore", ["--listen", "127.0.0.1:0"], Path(work), env=env)
            try:
                report = asyncio.run(run(args, svc.address))
            finally:
                svc.stop()
        if args.ttft_reps > 0:
            report["ttft"] = run_ttft(args, Path(work) / "ttft")
            print(json.dumps(report["ttft"]), file=sys.stderr)
    report["ucx_tls"] = os.environ.get("UCX_TLS", "default")  # the transports NIXL's UCX backend may use
    # The UCX TCP segment size the store's agent sends in (its own setting, over the environment's).
    report["ucx_tcp_seg_size"] = str(TCP_SEGMENT_BYTES)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "pagestore" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    json.dump(report, sys.stdout, indent=2)
    print()
    plot(report, out / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
