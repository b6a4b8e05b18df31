"""``DirectoryService`` with its state in etcd: the in-memory servicer whose writes go through the log.

Each mutating RPC proposes its command to :class:`~xavier_services.directory.etcd_store.EtcdLog` and
answers with what the local replica computed; each read first catches the replica up with etcd. The
handlers themselves (and feeds, waiters, wire forms, limits) are the in-memory servicer's, driven by the
replica's listener, so a room change proposed through any directory process reaches the feeds and
waiting calls of all.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.runtime.errors import XavierError
from xavier_core.runtime.logging import get_logger
from xavier_services.directory.commands import Command, Sweep
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.etcd_store import EtcdLog
from xavier_services.directory.servicer import Ctx, DirectoryServicer

__all__ = ["EtcdDirectoryServicer"]

_log = get_logger("xavier.directory.etcd")
R = TypeVar("R")


class EtcdDirectoryServicer(DirectoryServicer):
    """The directory RPCs over a replica of the etcd command log.

    Reads go through the base handlers inside :meth:`EtcdLog.reading`, which relies on those handlers
    not awaiting before they have read what they answer with.
    """

    def __init__(self, settings: DirectorySettings, log: EtcdLog | None = None) -> None:
        self.log = log if log is not None else EtcdLog(settings)
        super().__init__(settings, self.log.state)

    async def start(self, _handle: object = None) -> None:
        """Catches up with the log, then starts the sweeper."""
        await self.log.start()
        await super().start(_handle)

    async def stop(self, _handle: object = None) -> None:
        await super().stop(_handle)
        await self.log.stop()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_seconds)
            if self.state.next_deadline() <= self.log.wall():
                try:
                    await self.log.submit(Sweep())
                except XavierError as exc:
                    _log.warning("directory sweep not logged", error=str(exc))

    async def _apply(self, command: Command[R]) -> R:
        return await self.log.submit(command)

    async def _sync(self) -> None:
        await self.log.sync()

    def _reading(self) -> contextlib.AbstractContextManager[None]:
        return self.log.reading()

    async def GetDirectoryStats(
        self, req: dpb.GetDirectoryStatsRequest, ctx: Ctx
    ) -> dpb.GetDirectoryStatsResponse:
        # As the in-memory handler sweeps first, but a sweep is logged only when something is due.
        if self.state.next_deadline() <= self.log.wall():
            await self.log.submit(Sweep())
        else:
            await self.log.sync()
        return self._stats()
