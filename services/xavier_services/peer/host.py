"""PeerHost: the engine, its KV contract, its NIXL port and its membership in the directory.

Shared by the prefill, decode and unified services. The membership (`peer/membership.py`) registers,
heartbeats and registers again with a new epoch when the directory lost us, e.g. after a directory
restart (invariant I6).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import socket
import uuid
from collections.abc import Iterable
from typing import Any

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.contract import KvLayout, layout_from_model_dir
from xavier_core.directory import DirectoryClient
from xavier_core.directory.room_feed import RoomFeed
from xavier_core.engine.api import Engine
from xavier_core.pagestore import ClientSettings, PageStoreClient
from xavier_core.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    XavierError,
)
from xavier_core.runtime.identity import ROLE_NAMES
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer.port.kv_port import KvPort
from xavier_core.transfer.port.metrics import register_port_metrics
from xavier_services.peer.config import PeerServiceConfig
from xavier_services.peer.convert import features_pb
from xavier_services.peer.membership import Membership, PeerCache
from xavier_services.peer.sharing import PrefixSharing
from xavier_services.peer.warming import PeerWarmer

log = get_logger(__name__)
_DECODE_CACHE = 1024
_HANDOFF = {
    "pair": types_pb2.HANDOFF_PROTOCOL_PAIR,
    "directory": types_pb2.HANDOFF_PROTOCOL_DIRECTORY_ROOMS,
}


def _version() -> str:
    try:
        return importlib.metadata.version("xavier")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def load_engine(config: PeerServiceConfig) -> Engine:
    """Loads the reference engine named by the config (blocking; call off the event loop)."""
    from xavier_core.engine.reference import ReferenceEngine

    e = config.engine
    if e.model is None:
        raise InvalidArgument(
            "engine.model is required (a local Hugging Face checkpoint directory)", key="engine.model"
        )
    if e.compile and not e.device.startswith("cuda"):
        raise InvalidArgument(f"engine.compile needs a CUDA device, not {e.device!r}", key="engine.compile")
    engine: Engine = ReferenceEngine.load(
        e.model,
        device=e.device,
        dtype=e.dtype,
        page_size=e.page_size,
        num_pages=e.num_pages,
        max_running=e.max_running,
        chunk_tokens=e.chunk_tokens,
        chunk_gather_bytes=e.chunk_gather_bytes,
        compile_static=e.compile,
        compute=e.compute,
        max_queued=e.max_queued,
    )
    if e.device.startswith("cuda"):
        # Decode graphs are captured now, before the NIXL agent exists: a capture must not overlap
        # transfers on the same device. A prefill replica takes them too: a short chunk after cached keys
        # (a prefix hit's suffix) replays them, and only graphs captured already. (Null compute has none:
        # this captures 0.)
        n = engine.capture_decode_graphs()
        log.info("decode graphs captured", graphs=n)
    return engine


_SOURCES = {types_pb2.ROLE_DECODE: types_pb2.ROLE_PREFILL, types_pb2.ROLE_UNIFIED: types_pb2.ROLE_UNIFIED}
"""Whose pages a peer with a port reads: a decode its prefills', a sharing replica its fellow replicas'."""


class PeerHost:
    """Everything a prefill/decode/unified servicer needs besides its own request logic."""

    def __init__(self, config: PeerServiceConfig, role: types_pb2.Role.ValueType, engine: Engine) -> None:
        self.config = config
        self.role = role
        self.engine = engine
        self.vocab_size = engine.vocab_size
        e = config.engine
        if e.model is None:
            raise InvalidArgument("engine.model is required", key="engine.model")
        self.layout: KvLayout = layout_from_model_dir(
            e.model,
            engine="reference-null" if e.compute == "null" else "reference",  # null never meets real KV
            engine_version=_version(),
            dtype=engine.dtype_name,
            page_size=engine.page_size,
        )
        self.fingerprint = self.layout.fingerprint
        self.host_id = socket.gethostname()
        self.membership = Membership(
            role, config.peer.peer_id, config.peer.directory, config.peer.rpc_timeout_seconds
        )
        self.address = ""
        self.kv: KvPort | None = None  # prefill and decode roles, and unified with handoff.share_prefixes
        self.rooms: RoomFeed | None = None  # the prefill's feed of its rooms' states
        self.store: PageStoreClient | None = None  # prefill and unified roles, when configured
        self.sharing: PrefixSharing | None = None  # unified with a store and handoff.share_prefixes
        self.warmer: PeerWarmer | None = None  # a reader's port connected to its sources ahead of time
        self._decodes = PeerCache(
            self.membership, types_pb2.ROLE_DECODE, self.fingerprint, limit=_DECODE_CACHE
        )

    @property
    def peer_id(self) -> str:
        """This peer's id in the directory (named at start unless the config gave one)."""
        return self.membership.peer_id

    @property
    def epoch(self) -> int:
        """The epoch of the current registration (0 before the first)."""
        return self.membership.epoch

    @property
    def directory(self) -> DirectoryClient | None:
        """The directory client once started, else None."""
        return self.membership.client

    def layout_pb(self) -> types_pb2.KvLayout:
        """The layout this peer registers, with the features its engine honours."""
        layout = self.layout.to_proto()
        layout.features.extend(features_pb(self.engine.features))
        if self.role in (types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE):
            layout.handoff = _HANDOFF[self.config.handoff.protocol]
            layout.first_token_source = types_pb2.FIRST_TOKEN_SOURCE_PREFILL
            if self.config.peer.call_sessions:
                layout.service_features.append(types_pb2.SERVICE_FEATURE_CALL_SESSIONS)
        return layout

    @property
    def has_port(self) -> bool:
        """Whether this peer opens a KV transfer port: prefill and decode roles, and a unified replica
        that shares its prefixes (`handoff.share_prefixes`: a source for its peers' reads)."""
        if self.role == types_pb2.ROLE_UNIFIED:
            return self.config.handoff.share_prefixes
        return self.role in (types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE)

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self, port: int) -> dict[str, Any]:
        cfg = self.config
        self.address = f"{cfg.peer.advertise_host}:{port}"
        self.membership.name(self.host_id, port)
        if self.has_port:
            name = f"{self.peer_id}-{uuid.uuid4().hex[:8]}"
            self.kv = KvPort(
                name,
                self.engine.kv_buffers(),
                self.engine.page_size,
                cfg.handoff.source_poll_interval_seconds  # a source only: nothing waits on its polls
                if self.role == types_pb2.ROLE_PREFILL
                else cfg.handoff.poll_interval_seconds,  # a reader (a sharing replica reads its peers')
                cfg.handoff.transfer_mode,
                self.engine.device_lock,
                cfg.handoff.transport,
                slab_bytes=cfg.handoff.staging_slab_bytes,
                chunk_bytes=cfg.handoff.staging_chunk_bytes,
                read_end_agent=cfg.handoff.read_end_agent,
            )
            register_port_metrics(ROLE_NAMES[self.role], self.kv.stats)
        if cfg.pagestore.address:  # a decode writes its answers through (a chat's next turn reads them)
            self._attach_store()
        directory = self.membership.connect()
        req = dpb.RegisterPeerRequest(
            peer_id=self.peer_id, role=self.role, address=self.address, layout=self.layout_pb()
        )
        if self.kv is not None:
            req.endpoint.CopyFrom(self.kv.endpoint(self.host_id))
        await self.membership.join(req, self.load)
        if self.role == types_pb2.ROLE_PREFILL:
            self.rooms = RoomFeed(directory, lambda: (self.peer_id, self.epoch))
            self.rooms.start()
        sources = _SOURCES.get(self.role)
        if self.kv is not None and sources is not None and cfg.handoff.warm_interval_seconds > 0:
            self.warmer = PeerWarmer(
                self.kv,
                self.membership,
                sources,
                self.fingerprint,
                lambda: self.peer_id,
                cfg.handoff.warm_interval_seconds,
                self.sharing.connect if self.sharing is not None else None,
            )
            self.warmer.start()
        return {"peer_id": self.peer_id, "epoch": self.epoch, "fingerprint": self.fingerprint}

    def _attach_store(self) -> None:
        """Points the engine at the page store. Nothing is asked of the store now: a store that is down
        at start is a miss per request, and one that comes up later is found by the next request."""
        ps = self.config.pagestore
        settings = ClientSettings(
            rpc_timeout_s=ps.rpc_timeout_seconds,
            transfer_timeout_s=ps.transfer_timeout_seconds,
            lease_seconds=ps.lease_seconds,
            write_queue=ps.write_queue,
            staging_pages=ps.staging_pages,
            stage_host_pool=ps.stage_host_pool,
            read_piece_bytes=ps.read_piece_bytes,
            same_host_reads=ps.same_host_reads,
            check_while_reading=ps.check_while_reading,
            checked_read_part_bytes=ps.checked_read_part_bytes,
        )
        name = f"{self.peer_id}-store-{uuid.uuid4().hex[:8]}"
        store = self.store = PageStoreClient(
            ps.address, self.engine.kv_buffers(), settings, name=name, device_lock=self.engine.device_lock
        )
        share = None
        if self.kv is not None and self.role == types_pb2.ROLE_UNIFIED:  # has_port: it shares
            # A copy from the writer stands in for a store read: the store's deadlines bound it, so a
            # writer that stalls costs what a stalled store would before the fetch reads the store.
            self.sharing = PrefixSharing(
                self.kv,
                self.membership,
                self.fingerprint,
                lambda: (self.peer_id, self.epoch),
                ps.rpc_timeout_seconds,
                ps.transfer_timeout_seconds,
                self.config.handoff.park_timeout_seconds,
            )
            share = self.sharing.pull
            # The pages it writes name it (and its epoch: a replica registered again holds none of before).
            self.membership.on_epoch.append(lambda epoch: setattr(store, "holder", (self.peer_id, epoch)))
        handoff = self.config.handoff
        stand = (handoff.standing_share_seconds, handoff.standing_share_pool_fraction)
        self.engine.use_page_store(store, self.fingerprint, share, *stand)
        log.info("page store attached", address=ps.address)

    async def stop(self) -> None:
        if self.warmer is not None:
            await self.warmer.stop()
        if self.rooms is not None:
            await self.rooms.stop()
        await self.membership.leave()
        await self.membership.close()
        if self.sharing is not None:
            await self.sharing.close()
        if self.kv is not None:
            await self.kv.close()
        if self.store is not None:
            # Queued write-throughs are dropped (their pages released); no new ones start after this.
            await self.store.close()
        await self.engine.close()

    def load(self) -> dpb.PeerLoad:
        s = self.engine.stats()
        return dpb.PeerLoad(
            outstanding_requests=s.running + s.waiting, pages_free=s.pages_free, pages_total=s.pages_total
        )

    @property
    def port(self) -> KvPort:
        """The KV transfer port (`has_port`; a unified replica that does not share has none)."""
        if self.kv is None:
            raise FailedPrecondition(
                f"a {ROLE_NAMES[self.role]} peer has no KV transfer port", reason="WRONG_ROLE"
            )
        return self.kv

    @property
    def feed(self) -> RoomFeed:
        """The prefill's feed of its rooms' states (started with the peer)."""
        if self.rooms is None:
            raise FailedPrecondition("the room feed runs on prefill peers only", reason="WRONG_ROLE")
        return self.rooms

    def transfer_stats_pb(self) -> types_pb2.TransferStats:
        """The port's transfer counters (zeros for a replica without a port)."""
        return self.kv.transfer_stats_pb() if self.kv is not None else types_pb2.TransferStats()

    async def peer_host(self, peer: tuple[str, int]) -> str | None:
        """The host id of a decode peer's endpoint (one directory lookup per peer epoch); None if unknown."""
        try:
            found = await self._decodes.find(peer)
        except XavierError:
            return None
        return found.endpoint.host_id if found is not None else None

    # -- directory calls ------------------------------------------------------------------------------------

    @property
    def dir(self) -> DirectoryClient:
        """The directory client: every call has the configured deadline and retries only UNAVAILABLE (I7)."""
        return self.membership.dir

    async def abort_room(self, room_id: int, cause: dpb.RoomEndCause.ValueType, detail: str) -> None:
        with contextlib.suppress(XavierError):
            await self.dir.abort_room(
                room_id, cause, detail, self.peer_id, self.epoch, request_id=f"abort-{room_id}-{self.peer_id}"
            )

    async def end_rooms(self, room_ids: Iterable[int], detail: str, settled: asyncio.Event) -> bool:
        """On shutdown: ends the rooms (cause SHUTDOWN) all at once, so their other side stops waiting,
        then waits for ``settled`` (the servicer's last request done with the directory).

        Within half the grace, so the peer has the rest to unregister; False when that ran out.
        """
        cause = dpb.ROOM_END_CAUSE_SHUTDOWN
        try:
            async with asyncio.timeout(self.config.grace_seconds / 2):
                await asyncio.gather(*(self.abort_room(room_id, cause, detail) for room_id in set(room_ids)))
                await settled.wait()
        except TimeoutError:
            return False
        return True

    def engine_stats_pb(self, pages_parked: int) -> types_pb2.EngineStats:
        s = self.engine.stats()
        return types_pb2.EngineStats(
            pages_total=s.pages_total,
            pages_free=s.pages_free,
            pages_pinned=s.pages_pinned,
            pages_parked=pages_parked,
            running=s.running,
            waiting=s.waiting,
            prompt_tokens_computed=s.prompt_tokens_computed,
            prompt_tokens_cached=s.prompt_tokens_cached,
            prompt_tokens_cached_store=s.prompt_tokens_cached_store,
            store_hit_pages=s.store.hit_pages if s.store else 0,
            store_pages_written=s.store.pages_written if s.store else 0,
            store_writes_dropped=s.store.writes_dropped if s.store else 0,
            store_errors=s.store.errors if s.store else 0,
            pages_quarantined=s.pages_quarantined,
        )
