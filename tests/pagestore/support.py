"""Page store test helpers: pools shaped like a KV pool, a store process, and client processes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing as mp
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from xavier.v1 import page_store_service_pb2 as pb
from xavier.v1 import page_store_service_pb2_grpc as pb_grpc

from tests.support.procs import ServiceProc, start_service
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore.layout import Span
from xavier_core.prefix_keys import chain_seed, page_keys
from xavier_core.transfer.common.buffers import KvBuffer

NBUF, BPP, PAGES, TOKENS_PER_PAGE = 4, 2048, 64, 16
PAGE_BYTES = NBUF * BPP


def make_pool(seed: int | None, pages: int = PAGES, bpp: int = BPP, shared: int = 0) -> list[np.ndarray]:
    """NBUF buffers of `pages` pages; random bytes from `seed` (zeros if None). The first `shared` pages
    come from one fixed seed in every pool, as a shared prompt prefix would."""
    if seed is None:
        return [np.zeros(pages * bpp, np.uint8) for _ in range(NBUF)]
    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, 256, pages * bpp, dtype=np.uint8) for _ in range(NBUF)]
    if shared:
        common = np.random.default_rng(999)
        for a in pool:
            a[: shared * bpp] = common.integers(0, 256, shared * bpp, dtype=np.uint8)
    return pool


def buffers(pool: Sequence[np.ndarray], bpp: int = BPP) -> list[KvBuffer]:
    return [KvBuffer(a.ctypes.data, a.nbytes, bpp, "cpu") for a in pool]


def page_digest(pool: Sequence[np.ndarray], pages: Sequence[int], bpp: int = BPP) -> list[str]:
    """One digest per page over all its segments (what two pools must agree on, bitwise)."""
    out = []
    for p in pages:
        h = hashlib.sha256()
        for a in pool:
            h.update(a[p * bpp : (p + 1) * bpp].tobytes())
        out.append(h.hexdigest())
    return out


def chain(fingerprint: str, salt: str, prompt: int, pages: int) -> list[bytes]:
    """Page keys of a prompt (token ids derived from `prompt`) under a fingerprint and salt."""
    tokens = [(prompt * 7919 + i) % 50000 for i in range(pages * TOKENS_PER_PAGE)]
    return page_keys(chain_seed(fingerprint, salt), tokens, TOKENS_PER_PAGE)


def start_store(
    workdir: Path, *, arena: int = 8 << 20, chunk: int = 256 << 10, listen: str = "127.0.0.1:0", **env: str
) -> ServiceProc:
    full = {
        "XAVIER_PAGESTORE__ARENA_BYTES": str(arena),
        "XAVIER_PAGESTORE__CHUNK_BYTES": str(chunk),
        "XAVIER_GRACE_SECONDS": "2",
        **{f"XAVIER_PAGESTORE__{k.upper()}": v for k, v in env.items()},
    }
    return start_service("xavier-pagestore", ["--listen", listen], workdir, env=full)


def stub(address: str) -> tuple[grpc.Channel, pb_grpc.PageStoreServiceStub]:
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.PageStoreServiceStub(ch)


def stats(address: str) -> pb.GetPageStoreStatsResponse:
    ch, s = stub(address)
    with ch:
        resp: pb.GetPageStoreStatsResponse = s.GetPageStoreStats(pb.GetPageStoreStatsRequest(), timeout=5)
        return resp


def ns_stats(address: str, fingerprint: str) -> list[pb.NamespaceStats]:
    return [n for n in stats(address).namespaces if n.contract_fingerprint == fingerprint]


def raw_get(address: str, fp: str, keys: list[bytes], lease_s: float) -> pb.GetPagesResponse:
    """GetPages straight on the wire (a reader that holds its lease as long as the test wants)."""
    ch, s = stub(address)
    with ch:
        req = pb.GetPagesRequest(
            request_id=uuid.uuid4().hex,
            namespace=pb.PageNamespace(contract_fingerprint=fp),
            keys=keys,
            segment_bytes=[BPP] * NBUF,
            lease_seconds=lease_s,
        )
        resp: pb.GetPagesResponse = s.GetPages(req, timeout=5)
        return resp


def raw_release(address: str, lease_id: str, corrupt: list[int] | None = None) -> pb.ReleaseLeaseResponse:
    """ReleaseLease straight on the wire, naming `corrupt` pages (which the store then drops)."""
    ch, s = stub(address)
    with ch:
        req = pb.ReleaseLeaseRequest(
            request_id=uuid.uuid4().hex, lease_id=lease_id, corrupt_indices=corrupt or []
        )
        resp: pb.ReleaseLeaseResponse = s.ReleaseLease(req, timeout=5)
        return resp


async def scribble(address: str, vandal: PageStoreClient, fp: str, keys: list[bytes], index: int) -> None:
    """A stray writer with stale descriptors overwrites committed page `index` of `keys` (in namespace
    `fp`, no salt) with page 0 of its own pool, as a bug or bad memory would: its checksum no longer holds."""
    from xavier_core.pagestore.client import _spans

    got = raw_get(address, fp, keys, 5.0)
    page = one_page_spans(_spans(got.spans))[index]
    target = await vandal.conn.ensure_store(got.store_instance)
    rows = vandal.geometry.span_descriptors([page], vandal._bases, [0])
    await asyncio.to_thread(vandal.conn.move, "WRITE", target, rows, 1)
    if not raw_release(address, got.lease_id).released:
        raise RuntimeError("the scribbler's lease was not released")


def one_page_spans(spans: Sequence[Span]) -> list[Span]:
    """The spans cut into one span per page, in order."""
    return [Span(s.chunk_address, s.chunk_slots, s.first_slot + i, 1) for s in spans for i in range(s.count)]


# --- a client in its own process ------------------------------------------------------------------------


def _client_main(conn: Connection, address: str, seed: int | None, shared: int) -> None:
    async def run() -> None:
        pool = make_pool(seed, shared=shared)
        client = PageStoreClient(address, buffers(pool), ClientSettings(rpc_timeout_s=5.0))
        conn.send("ready")
        while True:
            cmd, args = await asyncio.to_thread(conn.recv)
            if cmd == "stop":
                await client.close()
                conn.send("closed")
                return
            reply: Any
            if cmd == "write":
                ns, keys, pages = args
                reply = await client.write(PageNamespace(*ns), keys, pages)
            elif cmd == "fetch":
                ns, keys, pages = args
                for a in pool:
                    a.reshape(PAGES, BPP)[pages] = 0
                hit = await client.lookup_and_fetch(PageNamespace(*ns), keys, pages)
                reply = (hit, page_digest(pool, pages[:hit]))
            elif cmd == "exists":
                ns, keys = args
                reply = await client.exists(PageNamespace(*ns), keys)
            elif cmd == "counters":
                reply = client.counters
            else:
                reply = f"unknown command {cmd}"
            conn.send(reply)

    asyncio.run(run())


@dataclass
class ClientProc:
    conn: Connection
    proc: mp.process.BaseProcess

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"client did not answer {cmd!r}")
        return self.conn.recv()


@contextlib.contextmanager
def client_process(address: str, seed: int | None, shared: int = 0) -> Iterator[ClientProc]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_client_main, args=(child, address, seed, shared), daemon=True)
    proc.start()
    client = ClientProc(parent, proc)
    try:
        if not parent.poll(60) or parent.recv() != "ready":
            raise TimeoutError("client process did not start")
        yield client
    finally:
        if proc.is_alive():
            with contextlib.suppress(OSError, TimeoutError, EOFError):
                client.call("stop", timeout=10)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
