"""The page store over UCX's TCP transport (no CMA between the processes, as where a container's seccomp
profile forbids `process_vm_readv`): the store sends 256 KiB TCP segments and its clients receive them
(`xavier_core.pagestore.nixl`), and a get is exact; a client that declares smaller segments (one of
xavier.v1.0 declares none) is refused the endpoint, by name, instead of having its process aborted by a
READ; the segment settings are the page store agents' alone."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import page_store_service_pb2 as pb

from tests.pagestore import support
from tests.pagestore.support import buffers, chain, make_pool, page_digest, start_store, stats
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore.nixl import CLIENT_UCX_ENV, STORE_UCX_ENV, TCP_SEGMENT_BYTES, PageAgent
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration

PAGES = 16  # one run of 16 pages: 32 KiB a descriptor, more than one UCX default (8 KiB) TCP segment


@pytest.fixture
def tcp_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServiceProc]:
    """A store, and this process's clients, whose UCX may not use CMA: the bytes go over TCP."""
    monkeypatch.setenv("UCX_TLS", "^cma")
    svc = start_store(tmp_path)
    yield svc
    assert svc.stop() == 0, svc.log()[-2000:]


def _idle(address: str) -> bool:
    got = stats(address)
    return got.leases == 0 and all(n.leases == 0 and n.pinned_pages == 0 for n in got.namespaces)


async def _read(address: str, ns: PageNamespace, keys: list[bytes]) -> tuple[int, int, list[str]]:
    """A fresh reader's fetch of `keys` into pages 20..: (hit, errors counted, digests of the pages)."""
    pool = make_pool(None)
    reader = PageStoreClient(
        address, buffers(pool), ClientSettings(transfer_timeout_s=5.0, same_host_reads=False)
    )
    dest = list(range(20, 20 + len(keys)))
    try:
        hit = (await reader.fetch(ns, keys, lambda n: dest[:n])).hit
        await reader.flush()
        return hit, reader.counters.errors, page_digest(pool, dest)
    finally:
        await reader.close()


async def test_a_get_over_tcp_is_exact(tcp_store: ServiceProc) -> None:
    assert STORE_UCX_ENV == {"UCX_TCP_TX_SEG_SIZE": "262144", "UCX_TCP_RX_SEG_SIZE": "262144"}
    assert CLIENT_UCX_ENV == {"UCX_TCP_RX_SEG_SIZE": "262144"}
    pool = make_pool(41)
    writer = PageStoreClient(tcp_store.address, buffers(pool))
    try:
        ns = PageNamespace("fp-tcp")
        keys = chain("fp-tcp", "", 1, PAGES)
        assert await writer.write(ns, keys, list(range(PAGES))) == PAGES
        hit, errors, got = await _read(tcp_store.address, ns, keys)
        assert (hit, errors) == (PAGES, 0)
        assert got == page_digest(pool, list(range(PAGES)))
    finally:
        await writer.close()
    assert _idle(tcp_store.address)


def test_a_client_that_takes_smaller_segments_gets_no_endpoint(tcp_store: ServiceProc) -> None:
    ch, stub = support.stub(tcp_store.address)
    try:
        for declared in (0, 8192, TCP_SEGMENT_BYTES - 1):  # 0: a client of xavier.v1.0
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStoreEndpoint(
                    pb.GetStoreEndpointRequest(tcp_receive_segment_bytes=declared), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            got = from_rpc_error(err.value)
            assert got.reason == "TCP_SEGMENT_TOO_SMALL"
            assert got.metadata == {
                "client_segment_bytes": str(declared or 8192),
                "store_segment_bytes": str(TCP_SEGMENT_BYTES),
            }
        ok = stub.GetStoreEndpoint(
            pb.GetStoreEndpointRequest(tcp_receive_segment_bytes=TCP_SEGMENT_BYTES), timeout=5
        )
        assert ok.tcp_segment_bytes == TCP_SEGMENT_BYTES and ok.endpoint.agent_metadata
    finally:
        ch.close()


def test_agent_settings_apply_to_that_agent_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "16384")
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    agent = PageAgent(f"env-{os.getpid()}", buffers(make_pool(None)), STORE_UCX_ENV)
    try:
        assert os.environ["UCX_TCP_RX_SEG_SIZE"] == "16384" and "UCX_TCP_TX_SEG_SIZE" not in os.environ
    finally:
        agent.close()
