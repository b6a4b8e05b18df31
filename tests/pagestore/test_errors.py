"""Bad input gets INVALID_ARGUMENT (or the lease codes) with one ErrorInfo naming the reason and field."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from xavier.v1 import page_store_service_pb2 as pb

from tests.pagestore.support import BPP, NBUF, buffers, chain, make_pool, stub
from tests.support.procs import ServiceProc
from xavier_core.pagestore import PageNamespace, PageStoreClient
from xavier_core.runtime.errors import from_rpc_error
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError

pytestmark = pytest.mark.integration

NS = pb.PageNamespace(contract_fingerprint="fp-errors")
KEYS = chain("fp-errors", "", 1, 2)
SEG = [BPP] * NBUF


def _put(**over: Any) -> pb.PutPagesRequest:
    fields: dict[str, Any] = {
        "request_id": uuid.uuid4().hex,
        "namespace": NS,
        "keys": KEYS,
        "segment_bytes": SEG,
    }
    fields.update(over)
    return pb.PutPagesRequest(**fields)


def _get(**over: Any) -> pb.GetPagesRequest:
    fields: dict[str, Any] = {"request_id": uuid.uuid4().hex, "namespace": NS, "keys": KEYS}
    fields.update(over)
    return pb.GetPagesRequest(**fields)


IA, NF = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
BAD = "INVALID_ARGUMENT"
CASES: list[tuple[str, str, Callable[[], Any], grpc.StatusCode, str, str]] = [
    ("short key", "GetPages", lambda: _get(keys=[b"x" * 31]), IA, BAD, "keys"),
    ("no keys", "ExistsPages", lambda: pb.ExistsPagesRequest(namespace=NS), IA, BAD, "keys"),
    ("too many keys", "GetPages", lambda: _get(keys=[bytes(32)] * 1025), IA, "TOO_MANY_KEYS", "keys"),
    ("no fingerprint", "PutPages", lambda: _put(namespace=pb.PageNamespace()), IA, BAD,
     "namespace.contract_fingerprint"),
    ("rank", "PutPages", lambda: _put(namespace=pb.PageNamespace(contract_fingerprint="f", rank=70000)), IA,
     BAD, "namespace.rank"),
    ("no request id", "PutPages", lambda: _put(request_id=""), IA, BAD, "request_id"),
    ("repeated keys", "PutPages", lambda: _put(keys=[KEYS[0], KEYS[0]]), IA, BAD, "keys"),
    ("no segments", "PutPages", lambda: _put(segment_bytes=[]), IA, BAD, "segment_bytes"),
    ("page over chunk", "PutPages", lambda: _put(segment_bytes=[1 << 20]), IA, BAD, "segment_bytes"),
    ("negative lease", "PutPages", lambda: _put(lease_seconds=-1.0), IA, BAD, "lease_seconds"),
    ("unknown lease", "ReleaseLease", lambda: pb.ReleaseLeaseRequest(request_id="r", lease_id="nope"), NF,
     "LEASE_NOT_FOUND", ""),
    ("unknown commit", "CommitPut", lambda: pb.CommitPutRequest(request_id="c", lease_id="nope"), NF,
     "LEASE_NOT_FOUND", ""),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "method", "make", "code", "reason", "field"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_names_reason_and_field(
    store: ServiceProc,
    what: str,
    method: str,
    make: Callable[[], Any],
    code: grpc.StatusCode,
    reason: str,
    field: str,
) -> None:
    ch, s = stub(store.address)
    with ch, pytest.raises(grpc.RpcError) as info:
        getattr(s, method)(make(), timeout=5)
    assert info.value.code() == code
    err = from_rpc_error(info.value)
    assert err.reason == reason
    if field:
        assert err.metadata["field"] == field


def test_namespace_keeps_its_page_size_and_lease_kinds_are_checked(store: ServiceProc) -> None:
    ch, s = stub(store.address)
    with ch:
        put = s.PutPages(_put(), timeout=5)
        assert list(put.reserved_indices) == [0, 1]
        # The namespace's first Put declared 4 x 2048-byte segments.
        for call in (
            lambda: s.PutPages(_put(keys=[bytes(32)], segment_bytes=[BPP] * 2), timeout=5),
            lambda: s.GetPages(_get(segment_bytes=[4096, 4096]), timeout=5),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            err = from_rpc_error(info.value)
            assert err.reason == "PAGE_SIZE_MISMATCH" and err.metadata["field"] == "segment_bytes"
        # Wrong checksum count, then a retry of the same request id returns the same reservation.
        with pytest.raises(grpc.RpcError) as info:
            s.CommitPut(
                pb.CommitPutRequest(request_id="x1", lease_id=put.lease_id, checksums=[bytes(16)]), timeout=5
            )
        assert from_rpc_error(info.value).metadata["field"] == "checksums"
        again = s.PutPages(_put(request_id="same-id"), timeout=5)
        assert s.PutPages(_put(request_id="same-id"), timeout=5) == again
        assert s.ReleaseLease(
            pb.ReleaseLeaseRequest(request_id="r1", lease_id=put.lease_id), timeout=5
        ).released
        assert not s.ReleaseLease(
            pb.ReleaseLeaseRequest(request_id="r2", lease_id=put.lease_id), timeout=5
        ).released


async def test_mismatched_reader_is_a_miss_not_an_exception(store: ServiceProc) -> None:
    pool = make_pool(31)
    writer = PageStoreClient(store.address, buffers(pool))
    odd = PageStoreClient(store.address, buffers(make_pool(None, bpp=1024), 1024))
    try:
        ns = PageNamespace("fp-odd")
        keys = chain("fp-odd", "", 1, 2)
        assert await writer.write(ns, keys, [0, 1]) == 2
        assert await odd.lookup_and_fetch(ns, keys, [0, 1]) == 0
        assert odd.counters.errors == 1
        with pytest.raises(Exception, match="local pages"):
            await odd.lookup_and_fetch(ns, keys, [0])  # a caller bug (lengths differ) does raise
    finally:
        await writer.close()
        await odd.close()


def test_metrics_are_exported(store: ServiceProc) -> None:
    text = urllib.request.urlopen(f"http://{store.metrics}/metrics", timeout=5).read().decode()
    for name in ("xavier_pagestore_pages", "xavier_pagestore_leases", "xavier_pagestore_hits_total"):
        assert name in text


def test_client_refuses_device_buffers_without_cuda() -> None:
    """A device pool goes through a host mirror built with CUDA: without CUDA it is refused up front,
    never read as host memory."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")
    gpu = [KvBuffer(1 << 20, 64 * BPP, BPP, "cuda:0") for _ in range(NBUF)]
    with pytest.raises(InvalidPagesError, match="no CUDA"):
        PageStoreClient("127.0.0.1:1", gpu)
