"""A peer service's place in the directory, one piece for every host (`peer/host.py` for the reference
engine, `sglang_host/host.py` for SGLang).

- `Membership`: the peer's id (`<role>-<host>-<port>` unless the config names one), its epoch, the
  directory client and the `PeerSession` that keeps the registration alive, registering again with a new
  epoch when the directory lost it (invariant I6).
- `PeerCache`: other peers of one role by (peer id, epoch), filled by one directory listing per epoch
  met. An epoch names one registration, so an entry never goes stale; the cache is bounded, oldest out
  first.
"""

from __future__ import annotations

from collections.abc import Callable

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.directory import DirectoryClient, PeerSession, Registration
from xavier_core.runtime.errors import Unavailable
from xavier_core.runtime.identity import ROLE_NAMES
from xavier_core.runtime.logging import get_logger

__all__ = ["Membership", "PeerCache"]

log = get_logger(__name__)
_REGISTER_ATTEMPTS = 20


class Membership:
    """One peer's registration: ``connect()``, then ``join()`` (register, heartbeat), ``leave()``
    (unregister), ``close()``. ``epoch`` follows every registration, so calls carry the current one."""

    def __init__(
        self, role: types_pb2.Role.ValueType, peer_id: str, directory: str, rpc_timeout: float
    ) -> None:
        self.role = role
        self.peer_id = peer_id
        self.epoch = 0
        self.client: DirectoryClient | None = None
        self._address = directory
        self._timeout = rpc_timeout
        self._session: PeerSession | None = None
        self.on_epoch: list[Callable[[int], None]] = []
        """Called with each new epoch, as it is registered."""

    def name(self, host_id: str, port: int) -> str:
        """The peer's id: the configured one, else ``<role>-<host>-<port>`` (set once, kept after)."""
        if not self.peer_id:
            self.peer_id = f"{ROLE_NAMES[self.role]}-{host_id}-{port}"
        return self.peer_id

    def connect(self) -> DirectoryClient:
        """Opens the directory client (each call with the configured deadline; retries only UNAVAILABLE)."""
        self.client = DirectoryClient(self._address, timeout=self._timeout)
        return self.client

    @property
    def dir(self) -> DirectoryClient:
        """The directory client; UNAVAILABLE before ``connect()``."""
        if self.client is None:
            raise Unavailable("not connected to the directory", reason="DIRECTORY_UNAVAILABLE")
        return self.client

    async def join(self, request: dpb.RegisterPeerRequest, load: Callable[[], dpb.PeerLoad]) -> None:
        """Registers (bounded retries of UNAVAILABLE) and keeps the registration alive, reporting ``load()``
        with every heartbeat."""
        self._session = PeerSession(
            self.dir,
            request,
            load=load,
            on_registered=self._on_registered,
            register_attempts=_REGISTER_ATTEMPTS,
        )
        await self._session.start()

    def _on_registered(self, reg: Registration) -> None:
        # A new epoch (first start, or re-registration after a directory restart): calls carry it from now on.
        self.epoch = reg.epoch
        log.info("registered", peer_id=self.peer_id, epoch=self.epoch)
        for call in self.on_epoch:
            call(self.epoch)

    async def leave(self) -> None:
        """Stops the heartbeats and unregisters (once); a directory that cannot be told lets the lease
        expire instead, which ends the peer's rooms later but ends them."""
        session, self._session = self._session, None
        if session is None:
            return
        try:
            await session.stop(unregister=True)
        except Exception as exc:
            log.warning("unregister failed; the lease expires instead", error=f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        """Closes the directory client, if one was opened."""
        if self.client is not None:
            await self.client.close()


class PeerCache:
    """Peers of one role (and contract, when given) by (peer id, epoch), one directory listing per miss.

    With ``zero_is_any``, epoch 0 in a lookup means "any registration of that id": the first one listed,
    then kept (an SGLang decode may be told its prefill's id alone).
    """

    def __init__(
        self,
        membership: Membership,
        role: types_pb2.Role.ValueType,
        fingerprint: str = "",
        *,
        limit: int,
        zero_is_any: bool = False,
    ) -> None:
        self._membership = membership
        self._role = role
        self._fingerprint = fingerprint
        self._limit = limit
        self._zero_is_any = zero_is_any
        self._peers: dict[tuple[str, int], dpb.Peer] = {}

    async def find(self, peer: tuple[str, int]) -> dpb.Peer | None:
        """The registration ``peer`` names, or None when the directory does not list it (its errors pass
        through)."""
        found = self._peers.get(peer)
        if found is not None:
            return found
        listed = await self._membership.dir.list_peers(self._role, self._fingerprint)
        for p in listed:
            self._peers[(p.peer_id, p.epoch)] = p
        peer_id, epoch = peer
        any_epoch = self._zero_is_any and not epoch
        found = next((p for p in listed if p.peer_id == peer_id and (any_epoch or p.epoch == epoch)), None)
        if found is not None:
            self._peers[peer] = found
        while len(self._peers) > self._limit:
            del self._peers[next(iter(self._peers))]
        return found
