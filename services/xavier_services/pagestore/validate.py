"""Request checks of the page store: each failure names the field (ErrorInfo metadata "field")."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from xavier.v1 import page_store_service_pb2 as pb

from xavier_core.pagestore.layout import CHECKSUM_BYTES, KEY_BYTES, PageGeometry
from xavier_core.runtime.errors import InvalidArgument
from xavier_core.transfer.common.runs import PageRun, expand
from xavier_services.pagestore.config import PageStoreSettings
from xavier_services.pagestore.store import Holder, Namespace, NsKey, Standing

MAX_FINGERPRINT_CHARS = 256
MAX_SALT_BYTES = 1024
MAX_RANK = 65535
MAX_REQUEST_ID_CHARS = 128
MAX_PEER_ID_CHARS = 256
MAX_HOLDER_RUNS = 1024
MAX_STANDING_SECONDS = 600.0


def namespace_key(ns: pb.PageNamespace) -> NsKey:
    fp = ns.contract_fingerprint
    if not fp or len(fp) > MAX_FINGERPRINT_CHARS:
        raise InvalidArgument(
            f"contract_fingerprint must have 1 to {MAX_FINGERPRINT_CHARS} characters, got {len(fp)}",
            field="namespace.contract_fingerprint",
        )
    salt = ns.cache_salt.encode("utf-8")
    if len(salt) > MAX_SALT_BYTES:
        raise InvalidArgument(
            f"cache_salt has {len(salt)} bytes, at most {MAX_SALT_BYTES}", field="namespace.cache_salt"
        )
    if ns.rank > MAX_RANK:
        raise InvalidArgument(f"rank {ns.rank} exceeds {MAX_RANK}", field="namespace.rank")
    return fp, hashlib.sha256(salt).digest(), ns.rank


def keys(values: Sequence[bytes], settings: PageStoreSettings, *, distinct: bool = False) -> list[bytes]:
    if not values:
        raise InvalidArgument("keys is empty", field="keys")
    limit = settings.max_keys_per_call
    if len(values) > limit:
        raise InvalidArgument(
            f"{len(values)} keys in one call, at most {limit}; split the chain into calls",
            reason="TOO_MANY_KEYS",
            field="keys",
            limit=limit,
        )
    for i, key in enumerate(values):
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"keys[{i}] has {len(key)} bytes, expected {KEY_BYTES}", field="keys")
    if distinct and len(set(values)) != len(values):
        raise InvalidArgument("keys repeat", field="keys")
    return list(values)


def geometry(values: Sequence[int], settings: PageStoreSettings, chunk_bytes: int) -> PageGeometry:
    if not values or len(values) > settings.max_segments:
        raise InvalidArgument(
            f"segment_bytes needs 1 to {settings.max_segments} entries, got {len(values)}",
            field="segment_bytes",
        )
    if any(v <= 0 for v in values):
        raise InvalidArgument("every segment_bytes entry must be at least 1", field="segment_bytes")
    geo = PageGeometry(tuple(int(v) for v in values))
    if geo.page_bytes > chunk_bytes:
        raise InvalidArgument(
            f"a page of {geo.page_bytes} bytes exceeds the arena chunk of {chunk_bytes} bytes",
            field="segment_bytes",
            chunk_bytes=chunk_bytes,
        )
    return geo


def same_geometry(ns: Namespace, values: Sequence[int]) -> None:
    """A namespace keeps the segment sizes of its first Put; anything else is PAGE_SIZE_MISMATCH."""
    if tuple(values) != ns.geometry.segment_bytes:
        got = sum(values)
        raise InvalidArgument(
            f"segment_bytes differ from the namespace's ({len(values)} segments, {got} bytes per page; "
            f"declared {len(ns.geometry.segment_bytes)} segments, {ns.geometry.page_bytes} bytes)",
            reason="PAGE_SIZE_MISMATCH",
            field="segment_bytes",
        )


def request_id(value: str) -> str:
    if not value or len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters", field="request_id"
        )
    return value


def lease_seconds(value: float, settings: PageStoreSettings) -> float:
    if value != value or value < 0:  # NaN compares unequal to itself
        raise InvalidArgument(f"lease_seconds must be >= 0, got {value}", field="lease_seconds")
    return settings.lease_seconds if value == 0 else min(value, settings.max_lease_seconds)


def checksums(values: Sequence[bytes], expected: int) -> list[bytes]:
    if len(values) != expected:
        raise InvalidArgument(f"{len(values)} checksums for {expected} reserved pages", field="checksums")
    for i, c in enumerate(values):
        if len(c) != CHECKSUM_BYTES:
            raise InvalidArgument(
                f"checksums[{i}] has {len(c)} bytes, expected {CHECKSUM_BYTES}", field="checksums"
            )
    return list(values)


def lease_id(value: str) -> str:
    if not value or len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("lease_id is empty or too long", field="lease_id")
    return value


def holder(value: pb.PageHolder) -> Holder:
    """A set ``PutPagesRequest.holder``: a reader is pointed at this peer id, so it must name one."""
    peer = value.peer_id
    if not peer or len(peer) > MAX_PEER_ID_CHARS:
        raise InvalidArgument(
            f"holder.peer_id must have 1 to {MAX_PEER_ID_CHARS} characters, got {len(peer)}",
            field="holder.peer_id",
        )
    return peer, int(value.epoch)


def standing(request: pb.PutPagesRequest) -> list[int] | None:
    """``PutPagesRequest.holder_page_runs`` as one pool page per key, or None when the put keeps nothing
    standing; the runs must cover exactly the keys, under a named holder, for 0 < seconds <= 600."""
    runs, seconds = request.holder_page_runs, request.holder_standing_seconds
    if not runs:
        if seconds:
            raise InvalidArgument(
                "holder_standing_seconds is set without holder_page_runs", field="holder_standing_seconds"
            )
        return None
    if not request.HasField("holder"):
        raise InvalidArgument("holder_page_runs needs a holder", field="holder")
    if not 0 < seconds <= MAX_STANDING_SECONDS:
        raise InvalidArgument(
            f"holder_standing_seconds must be in (0, {MAX_STANDING_SECONDS:g}], got {seconds}",
            field="holder_standing_seconds",
        )
    if len(runs) > MAX_HOLDER_RUNS:
        raise InvalidArgument(
            f"{len(runs)} holder_page_runs, at most {MAX_HOLDER_RUNS}", field="holder_page_runs"
        )
    if any(r.count == 0 for r in runs):
        raise InvalidArgument("a holder_page_runs run has count 0", field="holder_page_runs")
    total = sum(r.count for r in runs)
    if total != len(request.keys):
        raise InvalidArgument(
            f"holder_page_runs cover {total} pages for {len(request.keys)} keys", field="holder_page_runs"
        )
    return expand(PageRun(r.first_page, r.count) for r in runs)


def standing_of(ids: list[int] | None, indices: Sequence[int], seconds: float) -> Standing | None:
    """The reserved keys' pool pages (`indices` into the put's keys) and their standing, for the lease."""
    return ([ids[i] for i in indices], seconds) if ids is not None else None
