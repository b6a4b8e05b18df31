"""Snapshots of the directory state in etcd, and compaction of the command log behind them.

A snapshot of the state after log revision R lies under ``<prefix>snap/<R>/``: zlib-compressed
``snapshot.dump_state`` bytes in 1 MiB chunks ``c00000, c00001, ...`` (etcd refuses values over
1.5 MiB by default), then ``meta`` (the chunk count), written last: a snapshot without ``meta`` is one
whose writer died halfway, and is ignored. After writing one, older snapshots but the previous are
deleted and etcd's history is compacted to the previous one's revision, so a replica a little behind
still catches up by replaying the log instead of reloading a snapshot.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from xavier_core.runtime.errors import Unavailable
from xavier_core.runtime.logging import get_logger

__all__ = ["SnapshotStore"]

_log = get_logger("xavier.directory.etcd")
_CHUNK = 1 << 20

# call(fn) runs fn(kv stub, timeout), retrying while etcd is unreachable; Unavailable when it gives up.
Call = Callable[[Callable[[egrpc.KVStub, float], Any]], Awaitable[Any]]


class SnapshotStore:
    """Reads and writes the snapshots under one directory's key prefix."""

    def __init__(self, prefix: str, call: Call) -> None:
        self._root = prefix.encode() + b"snap/"
        self._call = call

    def _key(self, revision: int, part: str) -> bytes:
        return self._root + f"{revision:020d}/{part}".encode()

    async def _get(self, key: bytes) -> bytes:
        resp = await self._call(lambda kv, t: kv.Range(epb.RangeRequest(key=key), timeout=t))
        if not resp.kvs:
            raise Unavailable(f"directory snapshot key {key!r} is missing")
        value: bytes = resp.kvs[0].value
        return value

    async def _put(self, key: bytes, value: bytes) -> None:
        req = epb.PutRequest(key=key, value=value)
        await self._call(lambda kv, t: kv.Put(req, timeout=t))

    async def revisions(self) -> list[int]:
        """Revisions of the complete snapshots (their ``meta`` written), oldest first."""
        req = epb.RangeRequest(key=self._root, range_end=self._root[:-1] + b"0", keys_only=True)
        resp = await self._call(lambda kv, t: kv.Range(req, timeout=t))
        metas = [k.key[len(self._root) :] for k in resp.kvs if k.key.endswith(b"/meta")]
        return sorted(int(k.split(b"/")[0]) for k in metas)

    async def latest(self, after: int) -> tuple[int, bytes] | None:
        """(revision, state bytes) of the newest snapshot past revision ``after``, or None."""
        revisions = await self.revisions()
        if not revisions or revisions[-1] <= after:
            return None
        revision = revisions[-1]
        chunks = int(json.loads(await self._get(self._key(revision, "meta")))["chunks"])
        parts = [await self._get(self._key(revision, f"c{i:05d}")) for i in range(chunks)]
        return revision, zlib.decompress(b"".join(parts))

    async def write(self, revision: int, data: bytes) -> None:
        """Writes a snapshot (chunks, then meta), drops the older ones but one, compacts to that one."""
        packed = zlib.compress(data, 1)
        chunks = [packed[i : i + _CHUNK] for i in range(0, len(packed), _CHUNK)]
        for i, chunk in enumerate(chunks):
            await self._put(self._key(revision, f"c{i:05d}"), chunk)
        await self._put(self._key(revision, "meta"), json.dumps({"chunks": len(chunks)}).encode())
        older = [r for r in await self.revisions() if r < revision]
        if not older:
            return
        drop = epb.DeleteRangeRequest(key=self._root, range_end=self._key(older[-1], ""))
        await self._call(lambda kv, t: kv.DeleteRange(drop, timeout=t))
        # Compaction is etcd-wide but drops only superseded revisions of every key.
        compact = epb.CompactionRequest(revision=older[-1])
        try:
            await self._call(lambda kv, t: kv.Compact(compact, timeout=t))
        except Unavailable as exc:  # already compacted further (by another replica): fine
            _log.info("etcd compaction skipped", revision=older[-1], why=str(exc))
