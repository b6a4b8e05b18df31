"""Replicas share prefix pages through the store: B serves what A computed; salts never mix; a store that
dies and comes back never fails a request. Real processes, real NIXL DRAM transfers, the tiny model."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.pagestore.engines import (
    StoreMesh,
    engine_stats,
    generate,
    prefill_once,
    prefill_stats,
    prompt,
    wait_for,
)
from tests.pagestore.support import stats
from xavier_core.engine.tiny import make_tiny

pytestmark = pytest.mark.integration

PREFIX = 2000  # 125 full pages of 16 tokens
SUFFIX = 40


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreMesh]:
    model = make_tiny(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")
    m = StoreMesh(model, tmp_path_factory.mktemp("store-mesh"))
    try:
        m.start_directory()
        m.start_store()
        m.start_unified("unified-a", "--pagestore", m.store.address)
        m.start_unified("unified-b", "--pagestore", m.store.address)
        yield m
    finally:
        m.stop()


def _store_pages(mesh: StoreMesh, salt: str) -> int:
    """Pages the store holds under one tenant salt (the store reports a digest of each salt)."""
    digest = hashlib.sha256(salt.encode()).digest()[:8].hex()
    return sum(n.pages for n in stats(mesh.store.address).namespaces if n.salt_digest == digest)


async def _assert_quiet(mesh: StoreMesh) -> None:
    """I2: no request, pin or referenced page left in a replica; no lease or reservation in the store."""
    for name, proc in mesh.procs.items():
        if not name.startswith(("unified", "prefill")):
            continue
        read = prefill_stats if name.startswith("prefill") else engine_stats

        async def busy(addr: str = proc.address, read: Any = read) -> tuple[int, ...]:
            e = await read(addr)
            return (e.running, e.waiting, e.pages_pinned, e.pages_total - e.pages_free)

        for _ in range(200):  # write-throughs release their pages when the store answers (or, standing,
            # a few seconds later: tests/pagestore/test_prefix_sharing.py)
            if await busy() == (0, 0, 0, 0):
                break
            await asyncio.sleep(0.05)
        assert await busy() == (0, 0, 0, 0), name
    for _ in range(100):  # a fetch does not wait for its lease release to reach the store
        if stats(mesh.store.address).leases == 0:
            break
        await asyncio.sleep(0.05)
    got = stats(mesh.store.address)
    assert got.leases == 0
    assert all(n.leases == 0 and n.reserved_pages == 0 and n.pinned_pages == 0 for n in got.namespaces)


async def test_replica_b_serves_the_prefix_replica_a_computed(mesh: StoreMesh) -> None:
    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    shared = prompt(1, PREFIX)
    first, second = shared + prompt(2, SUFFIX), shared + prompt(3, SUFFIX)
    cold_a = await generate(a, first, salt="tenant-1")
    assert cold_a.usage.cached_tokens == 0
    # A writes its full prompt pages through, asynchronously.
    full = len(first) // 16
    await wait_for(lambda: _store_pages(mesh, "tenant-1") >= full, 30, "A's write-through")

    # The cold reference for B's prompt: the same prompt under a salt nobody used, so nothing is reused.
    cold_b = await generate(a, second, salt="cold-reference")
    assert cold_b.usage.cached_tokens == 0

    b0 = await engine_stats(b)
    warm = await generate(b, second, salt="tenant-1")
    b1 = await engine_stats(b)
    computed = b1.prompt_tokens_computed - b0.prompt_tokens_computed
    assert len(second) - computed >= 0.9 * PREFIX, f"B computed {computed} of {len(second)} prompt tokens"
    assert warm.usage.cached_tokens_store >= 0.9 * PREFIX
    assert warm.usage.cached_tokens == warm.usage.cached_tokens_store + warm.usage.cached_tokens_local
    assert warm.usage.cached_tokens == len(second) - computed
    assert b1.prompt_tokens_cached_store - b0.prompt_tokens_cached_store == warm.usage.cached_tokens_store
    assert b1.store_hit_pages - b0.store_hit_pages == warm.usage.cached_tokens_store // 16
    assert warm.tokens == cold_b.tokens

    # Again on B: now the pages are in B's own prefix cache.
    again = await generate(b, second, salt="tenant-1")
    assert again.usage.cached_tokens_local >= 0.9 * PREFIX and again.usage.cached_tokens_store == 0
    assert again.tokens == cold_b.tokens
    await _assert_quiet(mesh)


async def test_a_chats_next_turn_on_another_replica_finds_the_answer_in_the_store(mesh: StoreMesh) -> None:
    """A generating request writes its output pages through too: the next turn (prompt, answer, a new
    message) asked of B reads the answer's pages from the store, not only the first turn's prompt."""
    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    first = prompt(30, 200)  # 12 full pages and 8 tokens
    turn1 = await generate(a, first, salt="chat", max_tokens=100)
    full = (len(first) + len(turn1.tokens) - 1) // 16  # the last token's KV is never computed: 18 pages
    await wait_for(lambda: _store_pages(mesh, "chat") >= full, 30, "A's prompt and output write-through")
    second = first + turn1.tokens + prompt(31, 20)
    cold = await generate(a, second, salt="chat-cold-reference")
    warm = await generate(b, second, salt="chat")
    assert warm.usage.cached_tokens_store == full * 16 > (len(first) // 16) * 16
    assert warm.usage.cached_tokens_local == 0
    assert warm.tokens == cold.tokens
    await _assert_quiet(mesh)


async def test_prefill_replicas_share_through_the_store(mesh: StoreMesh) -> None:
    """The prefill role takes the same path: prefill B reuses what prefill A computed."""
    for name in ("prefill-a", "prefill-b"):
        if name not in mesh.procs:
            mesh.start_prefill(name, "--pagestore", mesh.store.address)
    a, b = mesh.procs["prefill-a"].address, mesh.procs["prefill-b"].address
    shared = prompt(20, PREFIX)
    cold = await prefill_once(a, shared + prompt(21, SUFFIX), salt="pd")
    assert cold.usage.cached_tokens == 0
    await wait_for(lambda: _store_pages(mesh, "pd") >= (PREFIX + SUFFIX) // 16, 30, "prefill write-through")
    reference = await prefill_once(a, shared + prompt(22, SUFFIX), salt="pd-cold")
    b0 = await prefill_stats(b)
    warm = await prefill_once(b, shared + prompt(22, SUFFIX), salt="pd")
    b1 = await prefill_stats(b)
    assert warm.usage.cached_tokens_store >= 0.9 * PREFIX and warm.usage.cached_tokens_local == 0
    assert b1.prompt_tokens_computed - b0.prompt_tokens_computed == PREFIX + SUFFIX - warm.usage.cached_tokens
    assert warm.first_token == reference.first_token
    # Bitwise pages, but on the GPU a prompt computed over cached pages takes another attention path
    # than one computed whole: float16 logprobs agree to rounding there, exactly on the CPU.
    tol = 0 if mesh.device == "cpu" else 1e-3
    assert warm.first_logprob == pytest.approx(reference.first_logprob, abs=tol)
    await _assert_quiet(mesh)


async def test_another_salt_gets_no_hit(mesh: StoreMesh) -> None:
    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    shared = prompt(10, PREFIX)
    await generate(a, shared + prompt(11, SUFFIX), salt="tenant-x")
    await wait_for(lambda: _store_pages(mesh, "tenant-x") >= (PREFIX + SUFFIX) // 16, 30, "write-through")
    b0 = await engine_stats(b)
    other = await generate(b, shared + prompt(12, SUFFIX), salt="tenant-y")
    assert (other.usage.cached_tokens, other.usage.cached_tokens_store) == (0, 0)
    no_salt = await generate(b, shared + prompt(12, SUFFIX))
    assert no_salt.usage.cached_tokens == 0
    b1 = await engine_stats(b)
    assert b1.store_hit_pages == b0.store_hit_pages
    assert b1.prompt_tokens_computed - b0.prompt_tokens_computed == 2 * (PREFIX + SUFFIX)
    await _assert_quiet(mesh)


async def test_a_stalled_store_is_a_miss_within_the_deadline(mesh: StoreMesh) -> None:
    """A store that stops answering (SIGSTOP) costs each request at most the RPC deadline (0.5 s by
    default), served as a miss; it never fails a request. When it resumes, sharing resumes."""
    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    shared = prompt(30, PREFIX)
    await generate(a, shared + prompt(31, SUFFIX), salt="stall")
    await wait_for(lambda: _store_pages(mesh, "stall") >= (PREFIX + SUFFIX) // 16, 30, "write-through")
    b0 = await engine_stats(b)
    mesh.store.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        stalled = await generate(b, shared + prompt(32, SUFFIX), salt="stall")
        elapsed = time.monotonic() - started
    finally:
        mesh.store.proc.send_signal(signal.SIGCONT)
    assert len(stalled.tokens) == 8 and stalled.usage.cached_tokens_store == 0
    assert elapsed < 10, f"a stalled store held the request {elapsed:.1f}s"
    b1 = await engine_stats(b)
    assert b1.store_errors > b0.store_errors
    resumed = await generate(b, shared + prompt(33, SUFFIX), salt="stall")
    # The stalled request computed the prefix itself, so B now holds it locally (or fetches it again).
    assert resumed.usage.cached_tokens >= 0.9 * PREFIX
    await _assert_quiet(mesh)


async def test_store_kill_and_restart_while_replicas_serve(mesh: StoreMesh) -> None:
    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    address = mesh.store.address
    failures: list[BaseException] = []
    served = 0
    stop = asyncio.Event()

    async def serve(addr: str, seed: int) -> None:
        nonlocal served
        i = 0
        while not stop.is_set():
            i += 1
            try:
                ans = await generate(addr, prompt(seed + i % 60, 300), salt="kill", max_tokens=4)
                assert len(ans.tokens) == 4
                served += 1
            except BaseException as exc:  # any failed request fails the test
                failures.append(exc)
                return

    load = [asyncio.create_task(serve(a, 1000)), asyncio.create_task(serve(b, 5000))]
    await wait_for(lambda: served >= 4, 60, "requests before the kill")
    mesh.store.stop(signal.SIGKILL)
    at_kill = served
    await wait_for(lambda: served >= at_kill + 4 or bool(failures), 60, "requests while the store is down")
    written = [(await engine_stats(addr)).store_pages_written for addr in (a, b)]
    mesh.start_store(listen=address)  # same address: replicas reconnect on their own
    at_restart = served
    # Each replica finds the new store by itself: its write-throughs land in it again.
    for addr, before in zip((a, b), written, strict=True):
        for _ in range(600):
            if failures or (await engine_stats(addr)).store_pages_written > before:
                break
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError(f"{addr} never wrote to the restarted store")
    await wait_for(lambda: served >= at_restart + 4 or bool(failures), 60, "requests after the restart")
    stop.set()
    await asyncio.gather(*load)
    assert not failures, failures

    # Sharing works again with the restarted store: B reuses what A writes now.
    shared = prompt(77, PREFIX)
    await generate(a, shared + prompt(78, SUFFIX), salt="after-restart")
    await wait_for(
        lambda: _store_pages(mesh, "after-restart") >= (PREFIX + SUFFIX) // 16, 30, "write to the new store"
    )
    warm = await generate(b, shared + prompt(79, SUFFIX), salt="after-restart")
    assert warm.usage.cached_tokens_store >= 0.9 * PREFIX
    e = await engine_stats(b)
    assert e.store_errors > 0  # the outage was seen and counted
    await _assert_quiet(mesh)
