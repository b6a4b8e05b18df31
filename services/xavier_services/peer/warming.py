"""A peer's transfer port connected to the peers it reads from before their first request.

A first pull from a peer sets up what every later one reuses: the peer's NIXL agent loaded, the read-end
agent's connection made, UCX's endpoints wired up, and on one host's GPUs the peer's pool mapped through
CUDA IPC. On a CPU box a first pull of three pages took 33.6 ms that way and 4.5 ms warmed (0.8 ms
later on): time a decode's first request to each new prefill spends before its second token, and a
sharing replica's first store hit from each writer before its first. `PeerWarmer` does it ahead: every
`interval` it lists the peers this one reads from (`role`, of its own layout) and warms the port to each
registration it has not tried yet (`KvPort.warm`; a sharing replica also opens its gRPC channel to it),
at most `MAX_WARMED` of them. A registration is tried once; one no longer listed is forgotten. Best
effort throughout: a directory that does not answer or a peer that cannot be warmed leaves the first pull
to connect, as it always did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.runtime.errors import XavierError
from xavier_core.runtime.logging import get_logger
from xavier_core.runtime.tasks import cancel_and_wait, every
from xavier_core.transfer import peer_key
from xavier_core.transfer.port.kv_port import KvPort
from xavier_services.peer.membership import Membership

log = get_logger(__name__)

MAX_WARMED = 64
"""Registrations warmed at most at once (a large mesh's others connect on their first pull)."""


class PeerWarmer:
    """Warms `port` to the listed peers of `role` and `fingerprint` other than this one (see the module
    docstring)."""

    def __init__(
        self,
        port: KvPort,
        membership: Membership,
        role: types_pb2.Role.ValueType,
        fingerprint: str,
        me: Callable[[], str],
        interval: float,
        connect: Callable[[dpb.Peer], Awaitable[None]] | None = None,
    ) -> None:
        self._connect = connect  # more to set up per new peer (a sharing replica's gRPC channel to it)
        self._port = port
        self._membership = membership
        self._role = role
        self._fingerprint = fingerprint
        self._me = me
        self._interval = interval
        self._tried: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = every(self._interval, self.once, self._skipped, "peer-warmer")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def once(self) -> int:
        """One listing: warms the registrations not tried yet; returns how many it warmed."""
        listed = await self._membership.dir.list_peers(self._role, self._fingerprint)
        me = self._me()
        peers = {
            peer_key(p.peer_id, p.epoch): p
            for p in listed
            if p.peer_id != me and p.HasField("endpoint") and p.endpoint.agent_metadata
        }
        self._tried &= peers.keys()  # gone from the listing: forgotten
        warmed = 0
        for key, p in peers.items():
            if key in self._tried or len(self._tried) >= MAX_WARMED:
                continue
            self._tried.add(key)
            warmed += await self._port.warm(key, p.endpoint)
            if self._connect is not None:
                await self._connect(p)
        return warmed

    @staticmethod
    def _skipped(err: XavierError) -> None:  # the directory did not answer: the next round asks again
        log.debug("peers not listed for warming", error=str(err))
