"""Live peers from the directory, channels to them, and least-outstanding-work selection."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import struct
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import error_reason_pb2 as er
from xavier.v1 import types_pb2

from xavier_core.directory import DirectoryClient
from xavier_core.runtime import FailedPrecondition, Unavailable, XavierError
from xavier_core.runtime.channels import open_channel
from xavier_core.runtime.retry import retry_unavailable
from xavier_core.runtime.session_client import CallSession
from xavier_services.router.health import PeerHealth, peer_key

T = TypeVar("T")
_RETRY_BASE_DELAY = 0.04
_RETRY_MAX_DELAY = 0.5
_PEER_WAIT_POLL = 0.1


@dataclass
class Pair:
    """A prefill and a decode peer with the same contract fingerprint."""

    prefill: dpb.Peer
    decode: dpb.Peer


def rendezvous(key: bytes, peer: dpb.Peer) -> bytes:
    """Peer `peer`'s rank for affinity `key` (highest first): the same in every process, so router processes
    that share no state send a new prefix to the same peer, and keys spread evenly over the peers."""
    return hashlib.blake2b(key + peer.peer_id.encode(), digest_size=8).digest()


def affinity_key(token_ids: Sequence[int], cache_salt: str, prefix_tokens: int) -> bytes | None:
    """The prefix-affinity key of a prompt: its first `prefix_tokens` tokens under its cache salt (None
    when affinity is off)."""
    if prefix_tokens <= 0 or not token_ids:
        return None
    head = token_ids[:prefix_tokens]
    h = hashlib.sha256(cache_salt.encode())
    # One pack of the whole prefix (4 bytes little-endian each, as before): a per-token to_bytes cost a
    # Python call per token on every request.
    h.update(b"\0" + struct.pack(f"<{len(head)}I", *head))
    return h.digest()


class PeerPool:
    """Caches ListPeers for `refresh_seconds`, keeps one channel per peer address, counts in-flight work.

    The directory is reached through a `DirectoryClient` that does not retry by itself: the router's
    steps retry as a whole (`retry_unavailable`), with a fresh peer list, so retries do not multiply.

    Selection scores a peer by the load it last reported plus the router's own in-flight requests on it
    (the report lags, the local count does not); ties break at random so equal peers share the work.
    Prefix affinity: a prompt whose leading tokens went to a prefill peer before goes there again (its
    prefix cache likely holds them) while that peer's score stays within `affinity_slack` of the best;
    a prefix new to this pool goes to the peer it ranks first of those within the slack (`rendezvous`),
    which every router process computes alike.
    Peers `health` has marked down, and those a request names in `exclude` (peer keys it already tried),
    are never chosen.
    """

    def __init__(
        self,
        directory: str,
        rpc_timeout: float,
        refresh_seconds: float,
        attempts: int,
        affinity_slack: float = 4.0,
        affinity_entries: int = 65536,
        health_interval: float = 1.0,
        health_timeout: float = 1.0,
        peer_sessions: bool = True,
        retire_after: float = 660.0,
    ) -> None:
        self.peer_sessions = peer_sessions
        # Channels and sessions of addresses the directory stopped listing are closed once absent this
        # long (past any request that may still stream from them), so a router under peer churn keeps
        # only its live peers' connections.
        self.retire_after = retire_after
        self._absent: dict[str, float] = {}  # address -> when the peer list first lacked it
        self._retiring: set[asyncio.Task[None]] = set()
        self.retired = 0
        self._sessions: dict[tuple[str, str], CallSession] = {}
        self.affinity_slack = affinity_slack
        self._affinity: OrderedDict[bytes, str] = OrderedDict()
        self._affinity_entries = affinity_entries
        self.affinity_hits = 0
        self.directory_address = directory
        self.rpc_timeout = rpc_timeout
        self.refresh_seconds = refresh_seconds
        self.attempts = attempts
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: list[dpb.Peer] = []
        self._fetched_at = -1e9
        self._lock = asyncio.Lock()
        self.inflight: dict[str, int] = defaultdict(int)
        self.health = PeerHealth(self.channel, health_interval, health_timeout)
        self.directory = (
            DirectoryClient(channel=self.channel(directory), timeout=rpc_timeout, retries=0)
            if directory
            else None
        )

    def channel(self, address: str) -> grpc.aio.Channel:
        """A shared channel to `address` (created on first use)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = open_channel(address)
            self._channels[address] = ch
        return ch

    def session(self, address: str, service: str, make: Callable[[], CallSession]) -> CallSession:
        """The call session to `service` ("prefill" or "decode") at `address` (made on first use; it
        reopens its own stream after a break)."""
        found = self._sessions.get((address, service))
        if found is None:
            found = self._sessions[(address, service)] = make()
        return found

    async def close(self) -> None:
        for task in list(self._retiring):
            await task
        await self.health.stop()
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def retry_unavailable(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Runs an idempotent step, retrying on UNAVAILABLE (bounded, with backoff and a fresh peer list)."""
        return await retry_unavailable(
            fn,
            attempts=self.attempts,
            base_delay=_RETRY_BASE_DELAY,
            max_delay=_RETRY_MAX_DELAY,
            on_retry=lambda _err: self.invalidate(),
        )

    async def wait_for_peers(self, fn: Callable[[], Awaitable[T]], wait_s: float) -> T:
        """`fn()`, asked again every 0.1 s with a fresh peer list while it fails with NO_PEERS, for up to
        `wait_s`: a request that arrives while the peers re-register waits for them instead of failing."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await fn()
            except Unavailable as err:
                if not err.is_reason(er.ERROR_REASON_NO_PEERS) or time.monotonic() >= deadline:
                    raise
            self.invalidate()
            await asyncio.sleep(_PEER_WAIT_POLL)

    def invalidate(self) -> None:
        """Forgets the cached peer list (after a peer failed)."""
        self._fetched_at = -1e9

    async def peers(self) -> list[dpb.Peer]:
        """Live peers, at most `refresh_seconds` old."""
        if time.monotonic() - self._fetched_at <= self.refresh_seconds:
            return self._peers
        async with self._lock:
            if time.monotonic() - self._fetched_at > self.refresh_seconds:
                self._peers = await self._list_all()
                self._fetched_at = time.monotonic()
                self._retire_departed()
        return self._peers

    def _retire_departed(self) -> None:
        """Closes, in the background, the channel and sessions of each address the peer list has lacked
        for `retire_after` (the directory's own never)."""
        now = time.monotonic()
        listed = {p.address for p in self._peers}
        listed.add(self.directory_address)
        for address in list(self._channels):
            if address in listed:
                self._absent.pop(address, None)
                continue
            if now - self._absent.setdefault(address, now) < self.retire_after:
                continue
            del self._absent[address]
            channel = self._channels.pop(address)
            sessions = [self._sessions.pop(key) for key in list(self._sessions) if key[0] == address]
            task = asyncio.get_running_loop().create_task(_close(channel, sessions))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            self.retired += 1

    async def _list_all(self) -> list[dpb.Peer]:
        if self.directory is None:
            return []
        try:
            return await self.directory.list_peers()
        except XavierError as err:
            transport = err.is_reason(er.ERROR_REASON_UNAVAILABLE, er.ERROR_REASON_SHUTTING_DOWN)
            if err.code != grpc.StatusCode.UNAVAILABLE or not transport:
                raise
            # A transport failure names internal addresses: say which service failed, not where.
            raise Unavailable(
                "the directory does not answer (it is down or restarting); retry shortly",
                reason="DIRECTORY_UNAVAILABLE",
                service="directory",
            ) from None

    async def usable(self, exclude: frozenset[str] = frozenset()) -> list[dpb.Peer]:
        """Listed peers that are healthy and not in `exclude` (peer keys)."""
        return [p for p in await self.peers() if self.health.is_up(p) and peer_key(p) not in exclude]

    def score(self, peer: dpb.Peer) -> float:
        return float(peer.load.outstanding_requests + self.inflight[peer.peer_id]) + random.random() * 0.1

    async def pick_unified(
        self, exclude: frozenset[str] = frozenset(), serves: Callable[[dpb.Peer], bool] | None = None
    ) -> dpb.Peer:
        """The least-loaded healthy unified replica, of those `serves` the request if any does."""
        peers = [p for p in await self.usable(exclude) if p.role == types_pb2.ROLE_UNIFIED]
        if not peers:
            raise Unavailable("no healthy unified replica is registered", reason="NO_PEERS", role="unified")
        return min(_preferred(peers, serves), key=self.score)

    async def pick_pair(
        self,
        affinity: bytes | None = None,
        exclude: frozenset[str] = frozenset(),
        serves: Callable[[dpb.Peer], bool] | None = None,
    ) -> Pair:
        """The least-loaded prefill peer that has a decode peer with its contract fingerprint (or the
        prefill the `affinity` key went to, if it is still close to the least loaded), and that
        fingerprint's least-loaded decode peer; only peers that `serves` the request (their engines
        declare what it needs) while there is such a pair, else any (whose engine then refuses it by
        name)."""
        peers = await self.usable(exclude)
        prefills = [p for p in peers if p.role == types_pb2.ROLE_PREFILL]
        decodes = [p for p in peers if p.role == types_pb2.ROLE_DECODE]
        if serves is not None:
            able_p, able_d = [p for p in prefills if serves(p)], [d for d in decodes if serves(d)]
            if {p.contract_fingerprint for p in able_p} & {d.contract_fingerprint for d in able_d}:
                prefills, decodes = able_p, able_d
        if not prefills or not decodes:
            raise Unavailable(
                "P/D needs a healthy prefill and decode peer",
                reason="NO_PEERS",
                prefill=len(prefills),
                decode=len(decodes),
            )
        by_fp: dict[str, list[dpb.Peer]] = defaultdict(list)
        for d in decodes:
            by_fp[d.contract_fingerprint].append(d)
        usable = [p for p in prefills if p.contract_fingerprint in by_fp]
        if not usable:
            raise FailedPrecondition(
                "no decode peer shares a contract fingerprint with any prefill peer",
                reason="LAYOUT_MISMATCH",
            )
        scores = {p.peer_id: self.score(p) for p in usable}
        prefill = min(usable, key=lambda p: scores[p.peer_id])
        if affinity is not None:
            prefill = self._affine(affinity, usable, scores, prefill)
        decode = min(by_fp[prefill.contract_fingerprint], key=self.score)
        return Pair(prefill, decode)

    def _affine(
        self, key: bytes, usable: list[dpb.Peer], scores: dict[str, float], best: dpb.Peer
    ) -> dpb.Peer:
        """The prefill for affinity `key`: the one it went to before, while within the slack of the least
        loaded; else, of the peers within the slack, the one the key ranks first (rendezvous hashing), so
        that other router processes, which remember nothing of this one's choices, choose it too."""
        limit = scores[best.peer_id] + self.affinity_slack
        remembered = self._affinity.get(key)
        if remembered is not None and scores.get(remembered, math.inf) <= limit:
            chosen = next(p for p in usable if p.peer_id == remembered)
            self.affinity_hits += 1
        else:
            chosen = max((p for p in usable if scores[p.peer_id] <= limit), key=lambda p: rendezvous(key, p))
        self._affinity[key] = chosen.peer_id
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._affinity_entries:
            self._affinity.popitem(last=False)
        return chosen

    def acquire(self, *peers: dpb.Peer) -> None:
        for p in peers:
            self.inflight[p.peer_id] += 1

    def release(self, *peers: dpb.Peer) -> None:
        for p in peers:
            self.inflight[p.peer_id] = max(0, self.inflight[p.peer_id] - 1)


async def _close(channel: grpc.aio.Channel, sessions: Sequence[CallSession]) -> None:
    for session in sessions:
        await session.close()
    await channel.close()


def _preferred(peers: list[dpb.Peer], serves: Callable[[dpb.Peer], bool] | None) -> list[dpb.Peer]:
    """The peers that `serves` the request, or all of them when none does (or no test is given)."""
    if serves is None:
        return peers
    able = [p for p in peers if serves(p)]
    return able or peers
