"""Keeps one peer registered with the directory: register, heartbeat, register again when told to.

When the directory answers a heartbeat with ``must_register`` or no longer knows the peer (it restarted,
or the lease lapsed) the session registers again and gets a new epoch. The client's channel reconnects
quickly, so that happens within about one heartbeat interval of the directory coming back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import error_reason_pb2 as er

from xavier_core.runtime.errors import NotFound, XavierError
from xavier_core.runtime.logging import get_logger
from xavier_core.runtime.tasks import cancel_and_wait

from .client import DirectoryClient, Registration

__all__ = ["OnRegistered", "PeerSession"]

_log = get_logger("xavier.directory.session")

OnRegistered = Callable[[Registration], Awaitable[None] | None]


class PeerSession:
    """Keeps one peer registered with the directory.

    ``start()`` registers (retrying UNAVAILABLE, bounded) and starts the heartbeat loop. Each heartbeat
    reports ``load()``; when the directory answers ``must_register`` or NOT_FOUND (it restarted, or the
    peer's lease lapsed), the session registers again and gets a new epoch; ``on_registered`` runs after
    every registration so the service can drop work tied to the old epoch. A heartbeat that fails with
    UNAVAILABLE is simply tried again at the next tick. STALE_EPOCH (another process registered the same
    peer id) is logged and not fought over.
    """

    def __init__(
        self,
        client: DirectoryClient,
        request: dpb.RegisterPeerRequest,
        *,
        load: Callable[[], dpb.PeerLoad] | None = None,
        on_registered: OnRegistered | None = None,
        heartbeat_interval: float | None = None,
        register_attempts: int = 5,
    ) -> None:
        self.client = client
        self._template = dpb.RegisterPeerRequest()
        self._template.CopyFrom(request)
        self._template.request_id = ""
        self._load = load
        self._on_registered = on_registered
        self._interval_override = heartbeat_interval
        self._attempts = register_attempts
        self._registration: Registration | None = None
        self._registered = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.registrations = 0
        """How many times this session registered (1 after ``start``; more after re-registrations)."""

    @property
    def registration(self) -> Registration:
        """The current registration (``start`` must have returned)."""
        if self._registration is None:
            raise RuntimeError("PeerSession is not registered; call start() first")
        return self._registration

    @property
    def interval(self) -> float:
        """Seconds between heartbeats."""
        if self._interval_override is not None:
            return self._interval_override
        return self._registration.heartbeat_interval if self._registration is not None else 1.0

    async def start(self) -> Registration:
        """Registers and starts heartbeating; returns the registration."""
        registration = await self._register()
        self._task = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{registration.peer_id}")
        return registration

    async def stop(self, *, unregister: bool = True) -> None:
        """Stops heartbeating and (by default) unregisters, best effort."""
        await cancel_and_wait(self._task)
        self._task = None
        if unregister and self._registration is not None:
            with contextlib.suppress(XavierError):
                reg = self._registration
                await self.client.unregister_peer(reg.peer_id, reg.epoch)

    async def wait_registered(self, newer_than: int = 0, *, timeout: float) -> Registration:
        """The first registration with an epoch above ``newer_than``; TimeoutError after ``timeout``."""

        def ready() -> bool:
            return self._registration is not None and self._registration.epoch > newer_than

        async with asyncio.timeout(timeout), self._registered:
            await self._registered.wait_for(ready)
        return self.registration

    async def _register(self) -> Registration:
        req = dpb.RegisterPeerRequest()
        req.CopyFrom(self._template)
        if self._registration is not None:
            req.peer_id = self._registration.peer_id  # keep a directory-assigned id across re-registrations
        registration = await self.client.register_peer(req, attempts=self._attempts)
        self._registration = registration
        self.registrations += 1
        _log.info("registered", peer_id=registration.peer_id, epoch=registration.epoch)
        if self._on_registered is not None:
            result = self._on_registered(registration)
            if inspect.isawaitable(result):
                await result
        async with self._registered:
            self._registered.notify_all()
        return registration

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            reg = self.registration
            try:
                load = self._load() if self._load is not None else None
                resp = await self.client.heartbeat(reg.peer_id, reg.epoch, load)
                if resp.must_register:
                    _log.warning(
                        "lost the directory lease; registering again",
                        peer_id=reg.peer_id,
                        epoch=reg.epoch,
                        cause="must_register",
                    )
                    await self._try_register()
            except NotFound:
                # The lease lapsed (a stall past it) or the directory restarted and forgot this peer.
                _log.warning(
                    "lost the directory lease; registering again", peer_id=reg.peer_id, epoch=reg.epoch
                )
                await self._try_register()
            except XavierError as err:
                if err.is_reason(er.ERROR_REASON_STALE_EPOCH):
                    _log.error("peer id registered elsewhere", peer_id=reg.peer_id, epoch=reg.epoch)
                else:
                    _log.debug("heartbeat failed", peer_id=reg.peer_id, reason=err.reason)

    async def _try_register(self) -> None:
        with contextlib.suppress(XavierError):
            await self._register()
