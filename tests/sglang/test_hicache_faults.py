"""The HiCache backend under faults, on SGLang's own host pool (`MHATokenToKVPoolHost`, as in
`test_hicache`) and a real page store process: a READ that may still write keeps its host pages out of
SGLang's pool (until it ended, or for good when NIXL could not cancel it), and a store that is stopped,
killed or restarted serves misses, counted, with one log line per stretch of trouble."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="the real sglang package is not installed")

import torch

from tests.pagestore.support import start_store
from tests.sglang.test_hicache import PAGE, backend, host_pool, page, sglang_keys, store
from tests.support.procs import ServiceProc
from xavier_core.pagestore.connection import TransferStuck
from xavier_core.pagestore.metrics import client_metrics

__all__ = ["store"]
pytestmark = [pytest.mark.sglang, pytest.mark.integration]


def _overlap(pool: Any, taken: torch.Tensor) -> set[int]:
    """What SGLang's pool lends next that `taken` holds: everything free is allocated, then returned."""
    rest = pool.alloc(pool.available_size())
    assert rest is not None
    pool.free(rest)
    return set(taken.tolist()) & set(rest.tolist())


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def read_then_checked(client: Any) -> Any:
    """`client` with its READs posted and then waited for (`StoreConnection.settle`), where a NIXL READ
    can end stuck or late; a same-host read checked as it lands is one call that cannot stick."""
    client.settings = dataclasses.replace(client.settings, check_while_reading=False)
    return client


@pytest.fixture
def pair(store: ServiceProc, tiny_model: Path) -> Iterator[tuple[Any, Any, Any, Any]]:
    """(writer pool, writer backend, reader pool, reader backend) on the module's store."""
    writer_pool, reader_pool = host_pool(seed=11), host_pool(seed=None)
    writer = backend(store.address, tiny_model, writer_pool)
    reader = backend(store.address, tiny_model, reader_pool)
    yield writer_pool, writer, reader_pool, reader
    writer.close()
    reader.close()


def test_a_stuck_read_keeps_its_host_pages_out_of_sglangs_pool(
    pair: tuple[Any, Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer_pool, writer, reader_pool, reader = pair
    keys = sglang_keys(3, first_token=3000)
    src = writer_pool.alloc(3 * PAGE)
    assert writer.batch_set_v1(keys, src) == [True] * 3

    real_settle = read_then_checked(reader.client).conn.settle

    def stuck(*a: Any) -> None:  # what a READ NIXL refused to cancel ends in
        real_settle(*a)
        raise TransferStuck("READ still in flight")

    monkeypatch.setattr(reader.client.conn, "settle", stuck)
    dst = reader_pool.alloc(3 * PAGE)  # SGLang's prefetch takes host pages, then asks the backend
    assert reader.batch_get_v1(keys, dst) == [False] * 3
    reader_pool.free(dst)  # ... and frees the pages it was told are missing
    assert _overlap(reader_pool, dst) == set(), "pages a READ may still write were lent again"
    # The fetch's end is settled by its future's callback, which may run just after the get returned.
    _wait(lambda: reader.get_stats()["lost_host_pages"] == 3, "the stuck READ's pages were not kept")
    assert _overlap(reader_pool, dst) == set(), "pages of a stuck READ were lent again"
    assert reader.quarantine.held_tokens == 3 * PAGE


def test_a_stuck_read_whose_end_is_told_gives_its_host_pages_back(
    pair: tuple[Any, Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A READ NIXL refused to cancel but lets go of when asked again (`TransferStuck.ended`): its host
    pages stay out of SGLang's pool until then, and come back then."""
    writer_pool, writer, reader_pool, reader = pair
    let_go = threading.Event()
    keys = sglang_keys(3, first_token=5000)
    assert writer.batch_set_v1(keys, writer_pool.alloc(3 * PAGE)) == [True] * 3
    real_settle = read_then_checked(reader.client).conn.settle

    def stuck(*a: Any) -> None:
        real_settle(*a)
        raise TransferStuck("READ still in flight", let_go.is_set)

    monkeypatch.setattr(reader.client.conn, "settle", stuck)
    dst = reader_pool.alloc(3 * PAGE)
    assert reader.batch_get_v1(keys, dst) == [False] * 3
    reader_pool.free(dst)
    _wait(lambda: reader.get_stats()["lost_host_pages"] == 3, "the stuck READ's pages were not kept")
    assert _overlap(reader_pool, dst) == set(), "pages of a stuck READ were lent again"
    let_go.set()  # the next ask finds the READ ended
    # The hold ends first and the pages are freed into SGLang's pool just after (outside the hold's lock):
    # wait for what SGLang sees, the pages lent again.
    want = set(dst.tolist())
    _wait(lambda: _overlap(reader_pool, dst) == want, "the stuck READ's pages never came back")
    assert reader.quarantine.held_tokens == 0
    assert reader.get_stats()["lost_host_pages"] == 0


def test_a_get_that_outlives_its_wait_keeps_its_pages_until_the_read_ended(
    pair: tuple[Any, Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer_pool, writer, reader_pool, reader = pair
    gate = threading.Event()
    try:
        keys = sglang_keys(2, first_token=4000)
        assert writer.batch_set_v1(keys, writer_pool.alloc(2 * PAGE)) == [True, True]
        real_settle = read_then_checked(reader.client).conn.settle

        def late(*args: Any) -> None:  # a READ still under way when the backend stops waiting
            gate.wait(60)
            real_settle(*args)

        monkeypatch.setattr(reader.client.conn, "settle", late)
        reader._wait_s = 0.2
        dst = reader_pool.alloc(2 * PAGE)
        assert reader.batch_get_v1(keys, dst) == [False, False]
        reader_pool.free(dst)
        assert _overlap(reader_pool, dst) == set(), "pages under a running READ were lent again"
        gate.set()  # the READ ends: the pages come back to the pool (just after the hold ends)
        want = set(dst.tolist())
        _wait(lambda: _overlap(reader_pool, dst) == want, "the hold was never lifted")
        assert reader.quarantine.held_tokens == 0
        assert reader.get_stats()["lost_host_pages"] == 0 and reader.errors == 1
    finally:
        gate.set()


def _client_errors() -> float:
    return sum(
        s.value for m in client_metrics().errors.collect() for s in m.samples if s.name.endswith("_total")
    )


def test_a_stopped_killed_or_restarted_store_serves_misses(
    tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    svc = start_store(tmp_path / "a", arena=4 << 20, chunk=64 << 10)
    writer_pool, reader_pool = host_pool(seed=13), host_pool(seed=None)
    knobs = {"rpc_timeout_s": 0.5, "transfer_timeout_s": 1.0, "log_interval_s": 3600}
    b = backend(svc.address, tiny_model, writer_pool, **knobs)
    r = backend(svc.address, tiny_model, reader_pool, **knobs)
    again: ServiceProc | None = None
    caplog.set_level(logging.WARNING, logger="xavier_core.pagestore.client")
    try:
        keys = sglang_keys(2, first_token=5000)
        src, dst = writer_pool.alloc(2 * PAGE), reader_pool.alloc(2 * PAGE)
        assert b.batch_set_v1(keys, src) == [True, True]
        assert r.batch_get_v1(keys, dst) == [True, True]
        # Slow (stopped): every call is a miss at its deadline, counted; one log line for all of them.
        errors_before, metric_before = r.client.counters.errors, _client_errors()
        os.kill(svc.proc.pid, signal.SIGSTOP)
        caplog.clear()
        for _ in range(3):
            assert r.batch_exists(keys) == 0
            assert r.batch_get_v1(keys, dst) == [False, False]
        failed = r.client.counters.errors - errors_before
        assert failed >= 6 and _client_errors() - metric_before >= failed
        lines = [m for m in caplog.messages if "page store" in m]
        assert len(lines) == 1 and "served as a miss" in lines[0], lines
        os.kill(svc.proc.pid, signal.SIGCONT)
        assert r.batch_get_v1(keys, dst) == [True, True]
        assert any("answering again" in m for m in caplog.messages)
        # Killed, then restarted at the same address (a new instance): misses, then hits again.
        svc.proc.kill()
        svc.proc.wait(10)
        assert r.batch_exists(keys) == 0 and r.batch_get_v1(keys, dst) == [False, False]
        again = start_store(tmp_path / "b", arena=4 << 20, chunk=64 << 10, listen=svc.address)
        _wait(lambda: b.batch_set_v1(keys, src) == [True, True], "the writer never reached the new store")
        assert r.batch_get_v1(keys, dst) == [True, True]
        for s, d in zip(src.tolist()[::PAGE], dst.tolist()[::PAGE], strict=True):
            assert torch.equal(page(reader_pool, d // PAGE), page(writer_pool, s // PAGE))
    finally:
        if svc.proc.poll() is None:
            os.kill(svc.proc.pid, signal.SIGCONT)
        b.close()
        r.close()
        svc.stop()
        if again is not None:
            again.stop()
