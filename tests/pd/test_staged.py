"""P/D over the staged NIXL transport (forced with `handoff.transport = staged`), real processes and
real NIXL DRAM transfers: greedy output equals colocated, a full slab falls back to page runs and stays
exact, and aborts leave no slab chunk held (I1, I2)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2

from tests.pd.conftest import FAST_ENV, Mesh, standard_mesh, wait_drained
from tests.pd.test_pd import LENGTHS, Channels, prompt
from tests.support.pd_driver import pd_generate, unified_generate

pytestmark = pytest.mark.integration

# The tiny model: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes (CPU, float32) = 8 KiB a
# page record. Chunks of 2 pages, 16 chunks: rooms up to 512 tokens fit (1,024 on CUDA, float16).
STAGED_ENV = {
    "XAVIER_HANDOFF__TRANSPORT": "staged",
    "XAVIER_HANDOFF__STAGING_CHUNK_BYTES": str(16 << 10),
    "XAVIER_HANDOFF__STAGING_SLAB_BYTES": str(256 << 10),
}


@pytest.fixture(scope="module")
def staged_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with standard_mesh(tiny_model, tmp_path_factory.mktemp("staged-mesh"), {**FAST_ENV, **STAGED_ENV}) as m:
        yield m


async def transfer_stats(mesh: Mesh) -> tuple[types_pb2.TransferStats, types_pb2.TransferStats]:
    async with (
        grpc.aio.insecure_channel(mesh.procs["prefill-0"].address) as p,
        grpc.aio.insecure_channel(mesh.procs["decode-0"].address) as d,
    ):
        ps = await pre_grpc.PrefillServiceStub(p).GetPrefillStats(pre.GetPrefillStatsRequest(), timeout=5)
        ds = await dec_grpc.DecodeServiceStub(d).GetDecodeStats(dec.GetDecodeStatsRequest(), timeout=5)
    return ps.transfer, ds.transfer


async def drained(mesh: Mesh) -> None:
    """Rooms, pinned and parked pages, and slab bytes in use are all back to 0."""
    stats = await wait_drained(mesh)
    assert not any(stats.values()), stats
    for _ in range(100):
        ps, ds = await transfer_stats(mesh)
        if ps.staging_bytes_in_use == ds.staging_bytes_in_use == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"slab bytes still held: prefill {ps.staging_bytes_in_use}, decode {ds.staging_bytes_in_use}"
    )


async def test_staged_pd_equals_unified_and_bytes_are_exact(staged_mesh: Mesh) -> None:
    ch = Channels(staged_mesh)
    try:
        p, d = await ch.peers()
        before_p, before_d = await transfer_stats(staged_mesh)
        for i, n in enumerate(LENGTHS):
            toks = prompt(n, i)
            got = await pd_generate(ch.directory, ch.prefill, ch.decode, p, d, toks, 12, digests=True)
            ref = await unified_generate(ch.unified, toks, 12)
            assert got.tokens == ref, f"prompt of {n} tokens"
            assert got.prefill_digest == got.decode_digest and len(got.decode_digest) == 32, n
        ps, ds = await transfer_stats(staged_mesh)
        # Every room went through both slabs: gathered on the prefill, pulled staged by the decode.
        assert ps.staged_transfers - before_p.staged_transfers == len(LENGTHS)
        assert ds.staged_transfers - before_d.staged_transfers == len(LENGTHS)
        assert ps.staging_fallbacks == before_p.staging_fallbacks
        await drained(staged_mesh)
    finally:
        await ch.close()
    metrics = scrape(staged_mesh, "decode-0")
    assert 'xavier_staging_bytes_in_use{role="decode"} 0.0' in metrics
    staged = 'xavier_transfers_by_transport_total{role="decode",transport="staged"} '
    assert float(next(ln for ln in metrics.splitlines() if ln.startswith(staged)).split()[-1]) >= len(LENGTHS)


def scrape(mesh: Mesh, name: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{mesh.procs[name].metrics}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


async def test_full_slab_falls_back_and_stays_exact(staged_mesh: Mesh) -> None:
    ch = Channels(staged_mesh)
    try:
        p, d = await ch.peers()
        before, _ = await transfer_stats(staged_mesh)
        toks = prompt(1100, 70)  # 69 pages: more than the whole slab holds
        got = await pd_generate(ch.directory, ch.prefill, ch.decode, p, d, toks, 8, digests=True)
        assert got.tokens == await unified_generate(ch.unified, toks, 8)
        assert got.prefill_digest == got.decode_digest
        after, _ = await transfer_stats(staged_mesh)
        assert after.staging_fallbacks == before.staging_fallbacks + 1
        # Concurrent rooms contend for the slab: some are staged, some fall back, all exact.
        prompts = [prompt(100 + 37 * i, 300 + i) for i in range(12)]
        refs = [await unified_generate(ch.unified, t, 6) for t in prompts]
        results = await asyncio.gather(
            *(pd_generate(ch.directory, ch.prefill, ch.decode, p, d, t, 6) for t in prompts)
        )
        assert [r.tokens for r in results] == refs
        await drained(staged_mesh)
    finally:
        await ch.close()


async def test_cancel_mid_transfer_frees_every_slab_chunk(staged_mesh: Mesh) -> None:
    ch = Channels(staged_mesh)
    rng = random.Random(11)
    try:
        p, d = await ch.peers()
        for i in range(12):
            toks = prompt(rng.randrange(40, 500), 2000 + i)
            task = asyncio.ensure_future(pd_generate(ch.directory, ch.prefill, ch.decode, p, d, toks, 64))
            await asyncio.sleep(rng.choice([0.0, 0.005, 0.02, 0.05, 0.1]))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await drained(staged_mesh)
        # The mesh still serves, staged, after the cancellations.
        toks = prompt(90, 9)
        got = await pd_generate(ch.directory, ch.prefill, ch.decode, p, d, toks, 8)
        assert got.tokens == await unified_generate(ch.unified, toks, 8)
        await drained(staged_mesh)
    finally:
        await ch.close()
