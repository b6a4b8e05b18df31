"""Which peers the router leaves out of selection, and the probe that brings them back.

The directory drops a dead peer only when its lease lapses (seconds); the router cannot wait that long:
a peer that refuses a connection or answers UNAVAILABLE is marked down at once by the call that saw it,
and a background loop probes every listed peer (grpc.health.v1 Check, each with a deadline, all at
once) so a peer that stalls is found without a request having to hit it, and a down peer that answers
SERVING again is re-admitted. Peers are keyed by id and epoch: a restarted peer is a new, healthy one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.runtime import XavierError, get_logger
from xavier_core.runtime.tasks import cancel_and_wait, every

_log = get_logger("xavier.router.health")
_SERVING = health_pb2.HealthCheckResponse.SERVING
# A probe that only timed out must fail this many times in a row: a busy peer on a loaded host may
# answer one probe late without being stalled. A refused connection or NOT_SERVING counts at once.
_TIMEOUTS_TO_DOWN = 2


def peer_key(peer: dpb.Peer) -> str:
    """A peer's identity for health: id and epoch."""
    return f"{peer.peer_id}@{peer.epoch}"


def role_name(role: int) -> str:
    return types_pb2.Role.Name(role).removeprefix("ROLE_").lower() if role else "unknown"


class PeerHealth:
    """Down peers (with why) and the probe loop; selection asks `is_up`."""

    def __init__(
        self,
        channel: Callable[[str], grpc.aio.Channel],
        interval: float,
        timeout: float,
        on_change: Callable[[dpb.Peer, bool, str], None] | None = None,
    ) -> None:
        self._channel = channel
        self.interval = interval
        self.timeout = timeout
        self.on_change = on_change
        self._down: dict[str, str] = {}
        self._timeouts: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def is_up(self, peer: dpb.Peer) -> bool:
        return peer_key(peer) not in self._down

    @property
    def down(self) -> dict[str, str]:
        """Down peer keys and why (a copy)."""
        return dict(self._down)

    def mark_down(self, peer: dpb.Peer, why: str) -> None:
        """Leaves `peer` out of selection until a probe finds it SERVING."""
        key = peer_key(peer)
        if key in self._down:
            return
        self._down[key] = why
        _log.warning("peer out of selection", peer_id=peer.peer_id, epoch=peer.epoch, why=why)
        if self.on_change is not None:
            self.on_change(peer, False, why)

    def mark_up(self, peer: dpb.Peer) -> None:
        key = peer_key(peer)
        self._timeouts.pop(key, None)
        if self._down.pop(key, None) is not None:
            _log.info("peer back in selection", peer_id=peer.peer_id, epoch=peer.epoch)
            if self.on_change is not None:
                self.on_change(peer, True, "")

    async def probe(self, peer: dpb.Peer) -> None:
        """One Check of `peer` with the probe deadline; updates its state."""
        stub = health_pb2_grpc.HealthStub(self._channel(peer.address))
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            key = peer_key(peer)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._timeouts[key] = self._timeouts.get(key, 0) + 1
                if self._timeouts[key] < _TIMEOUTS_TO_DOWN:
                    return
                self.mark_down(peer, f"health check timed out ({self.timeout:g} s)")
            else:
                self.mark_down(peer, f"health check failed: {exc.code().name}")
            return
        if resp.status == _SERVING:
            self.mark_up(peer)
        else:
            self.mark_down(peer, f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")

    async def probe_all(self, peers: list[dpb.Peer]) -> None:
        """Probes every peer concurrently and forgets peers the directory no longer lists."""
        await asyncio.gather(*(self.probe(p) for p in peers))
        listed = {peer_key(p) for p in peers}
        for key in [k for k in self._down if k not in listed]:
            del self._down[key]
        for key in [k for k in self._timeouts if k not in listed]:
            del self._timeouts[key]

    def start(self, peers: Callable[[], Awaitable[list[dpb.Peer]]]) -> None:
        """Runs the probe loop over `peers()` every `interval` until `stop`."""

        async def probe_listed() -> None:
            await self.probe_all(await peers())

        def skipped(err: XavierError) -> None:  # a directory outage: keep the last states
            _log.info("health probe skipped", error=str(err))

        self._task = every(self.interval, probe_listed, skipped, "peer-health")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
