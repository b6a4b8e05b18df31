"""A replica's reads of prefix pages from the replica that wrote them (`handoff.share_prefixes`).

The page store names the replica that wrote the pages a fetch hit (`GetPagesResponse.holder`). Where
that replica may still hold them in its own pool, copying them from there is cheaper than READing the
store's DRAM: between replicas of one host's GPUs the transfer port copies pool to pool through CUDA
IPC, where a store read crosses host memory and is checked page by page. So before it READs the store, a
fetch asks the holder (`DecodeService.SharePrefix`): the holder pins the prefix pages it still has and
publishes them as a transfer source for this one read, and the port pulls them into the pages the fetch
took, as a decode pulls a prefill's (the read's end, told by the port, unpins them there).

Pages the holder let stand after writing them (`handoff.standing_share_seconds`) come with their place
in its pool in the store's answer (`Standing`): those are copied at once, the holder told nothing
(a silent pull: they stand for every reader), if the copy can end before they stop standing; only
where they stand no more, or where the copy cannot start (no CUDA IPC or NIXL reach to the holder), is
the holder asked.

Anything short of every asked page (the holder is this replica, gone, re-registered, no longer holds
them, refuses, or the pull fails) answers 0 and the fetch READs the store as before: sharing can only
save a read, never fail a request. The store lease taken by GetPages covers the pages meanwhile. The one
exception is a failed pull whose copy was still running at the park timeout: the pages may still change,
so the fetch ends there (`HolderStuck`) and its pages are kept out of use until the copy has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Sequence

import grpc
from xavier.v1 import decode_service_pb2 as pb
from xavier.v1 import decode_service_pb2_grpc, types_pb2
from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.pagestore.client import Standing
from xavier_core.pagestore.connection import HolderStuck
from xavier_core.pagestore.metrics import StepClock
from xavier_core.runtime.channels import open_channel
from xavier_core.runtime.errors import XavierError, from_rpc_error
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer import peer_key
from xavier_core.transfer.common.errors import TransferError
from xavier_core.transfer.common.source import page_runs_proto
from xavier_core.transfer.port.kv_port import KvPort
from xavier_core.transfer.port.pulls import ReadStuck
from xavier_services.peer.membership import Membership, PeerCache

log = get_logger(__name__)

_PEERS = 256
"""Holder registrations remembered (one directory lookup per holder epoch)."""
MIN_STANDING_S = 0.25
"""Pages that stand for less than this longer are asked for instead: a copy must end while they stand."""


class PrefixSharing:
    """Pulls pages a fetch hit in the store from their holder's pool (see the module docstring)."""

    def __init__(
        self,
        port: KvPort,
        membership: Membership,
        fingerprint: str,
        me: Callable[[], tuple[str, int]],
        rpc_timeout: float,
        transfer_timeout: float,
        park_timeout: float,
    ) -> None:
        self._port = port
        self._me = me
        self._holders = PeerCache(membership, types_pb2.ROLE_UNIFIED, fingerprint, limit=_PEERS)
        self._channels: dict[str, grpc.aio.Channel] = {}  # by holder address
        self._rpc_timeout = rpc_timeout
        self._transfer_timeout = transfer_timeout
        self._park_timeout = park_timeout

    async def pull(
        self,
        holder: tuple[str, int],
        token_ids: Sequence[int],
        cache_salt: str,
        first_page: int,
        dest: list[int],
        standing: Standing | None = None,
    ) -> int:
        """Pulls pages `first_page ...` of the prefix `token_ids` (whole pages, keys chained from the
        first) from `holder` into the local pages `dest`; returns len(dest) when all of them came, else 0
        (whatever landed in `dest` is then overwritten by the store's READ). `standing`: where those
        pages stand in the holder's pool, copied from there without asking."""
        me = self._me()
        if holder == me or not dest:
            return 0
        try:
            if standing is not None and standing.deadline - time.monotonic() >= MIN_STANDING_S:
                got = await self._pull_standing(holder, standing, dest)
                if got is not None:
                    return got
            return await self._pull(holder, me, token_ids, cache_salt, first_page, dest)
        except XavierError as err:  # never a `HolderStuck` (a transfer error): that one ends the fetch
            log.info("prefix sharing: the holder's pages did not come", holder=holder[0], reason=err.reason)
            return 0

    async def _pull_standing(
        self, holder: tuple[str, int], standing: Standing, dest: list[int]
    ) -> int | None:
        """Copies pages that stand in the holder's pool, telling it nothing; the copy must end before they
        stop standing. None when it failed or could not start, with nothing in flight: ask instead (the
        ask's pull overwrites whatever landed)."""
        clock = StepClock()
        try:
            peer = await self._holders.find(holder)
            if peer is None or not peer.HasField("endpoint"):
                return 0  # gone, registered again, or a replica that does not share
            source = dpb.SourceDescriptor(page_runs=page_runs_proto(standing.pages), num_pages=len(dest))
            room_id = secrets.randbits(63) or 1
            with clock.step("holder_copy"):
                try:
                    timeout = min(self._transfer_timeout, standing.deadline - time.monotonic())
                    key, timeouts = peer_key(*holder), (timeout, self._park_timeout)
                    await self._port.pull(room_id, source, peer.endpoint, key, dest, *timeouts, silent=True)
                except ReadStuck as err:  # the pages are the fetch's to keep until the copy has ended
                    released = self._port.take_stuck(room_id)
                    raise HolderStuck(f"copy from {holder[0]}: {err.message}", released) from err
                except (XavierError, TransferError) as err:  # nothing is in flight any more: ask instead
                    log.info("prefix sharing: standing pages not copied", holder=holder[0], error=str(err))
                    return None
                finally:
                    self._port.take_stuck(room_id)
            return len(dest)
        finally:
            clock.flush()

    async def _pull(
        self,
        holder: tuple[str, int],
        me: tuple[str, int],
        token_ids: Sequence[int],
        cache_salt: str,
        first_page: int,
        dest: list[int],
    ) -> int:
        clock = StepClock()  # the fetch's "holder" step in two parts, in the same metric
        try:
            with clock.step("holder_ask"):
                peer = await self._holders.find(holder)
                if peer is None or not peer.HasField("endpoint"):
                    return 0  # gone, registered again, or a replica that does not share
                room_id = secrets.randbits(63) or 1
                req = pb.SharePrefixRequest(
                    room_id=room_id,
                    token_ids=token_ids,
                    cache_salt=cache_salt,
                    reader_peer_id=me[0],
                    reader_epoch=me[1],
                    first_page=first_page,
                )
                try:
                    stub = decode_service_pb2_grpc.DecodeServiceStub(self._channel(peer.address))
                    resp = await stub.SharePrefix(req, timeout=self._rpc_timeout)
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
            key = peer_key(*holder)
            if resp.pages != len(dest):
                if resp.pages:  # a source for fewer pages: say so at once, so the holder unpins them
                    await self._port.decline(room_id, resp.source.read_token, peer.endpoint, key)
                return 0
            with clock.step("holder_copy"):
                try:
                    timeouts = (self._transfer_timeout, self._park_timeout)
                    await self._port.pull(room_id, resp.source, peer.endpoint, key, dest, *timeouts)
                except ReadStuck as err:  # the pages are the fetch's to keep until the copy has ended
                    released = self._port.take_stuck(room_id)
                    raise HolderStuck(f"copy from {holder[0]}: {err.message}", released) from err
                finally:
                    self._port.take_stuck(room_id)  # a cancelled stuck copy: nobody waits for its end
            return len(dest)
        finally:
            clock.flush()

    async def connect(self, peer: dpb.Peer) -> None:
        """Opens the channel to a fellow replica before its first SharePrefix (`PeerWarmer`), waiting for
        it at most the RPC deadline: best effort, a channel not ready yet still connects on first use."""
        with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
            await asyncio.wait_for(self._channel(peer.address).channel_ready(), self._rpc_timeout)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
