"""SglangHost: the SGLang server a prefill, decode or unified service hosts, and the service's place in
the mesh.

Who registers with the directory:
- P/D roles with the xavier backend: the SGLang process itself (the plugin's KV manager registers role,
  epoch, contract and NIXL endpoint) under the *service's* gRPC address, so the router calls the service
  and a decode finds its prefill by that address. The service registers nothing of its own.
- unified: the service registers (role, address, a layout with engine "sglang").
- the nixl backend: nobody; the router's native mode calls SGLang over HTTP.

A dead SGLang is not restarted here: the service goes NOT_SERVING, unregisters what the child had
registered (the directory ends their rooms as PEER_LOST at once rather than at lease expiry) and exits
non-zero, and whatever supervises the service (`xavier up`, systemd `Restart=`) restarts it with its
bounded backoff. One restart policy, one place; a restart is a fresh process with a fresh epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_sglang.features import declare

from xavier_core.contract import layout_from_model_dir
from xavier_core.directory import DirectoryClient
from xavier_core.runtime import ServerHandle
from xavier_core.runtime.config import ConfigError
from xavier_core.runtime.errors import InvalidArgument, NotFound, Unavailable, XavierError
from xavier_core.runtime.logging import get_logger
from xavier_services.peer.config import PeerServiceConfig
from xavier_services.peer.membership import Membership, PeerCache
from xavier_services.sglang_host.child import SglangChild
from xavier_services.sglang_host.client import SglangHttp
from xavier_services.sglang_host.launch import LaunchSpec, build_launch
from xavier_services.sglang_host.salt import SaltSupport, lora_refusal, salt_support

log = get_logger(__name__)
_PREFILL_CACHE = 256


def free_port() -> int:
    """A port free now on 127.0.0.1. SGLang takes a port number, not a socket, so the port is released
    before SGLang binds it; a race lost here makes SGLang exit, which the service reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangHost:
    """Starts, supervises and stops the SGLang child; the directory face of the service."""

    def __init__(self, config: PeerServiceConfig, role: types_pb2.Role.ValueType) -> None:
        self.config = config
        self.role = role
        self.address = ""
        self.membership = Membership(
            role, config.peer.peer_id, config.peer.directory, config.peer.rpc_timeout_seconds
        )
        self.inflight = 0
        self.stopping = False
        """Set once a stop began: new requests are refused, so the wait for those in flight ends."""
        self._idle = asyncio.Event()
        self._idle.set()
        self.failed = ""
        """Why SGLang died (empty while it runs); the service exits non-zero when set."""
        self.child: SglangChild | None = None
        self.http: SglangHttp | None = None
        self._watch: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._prefills = PeerCache(
            self.membership, types_pb2.ROLE_PREFILL, limit=_PREFILL_CACHE, zero_is_any=True
        )
        self.salts = SaltSupport("", None, "SGLang has not started")
        """How a request's cache salt reaches this SGLang (read from its release once it is healthy)."""

    @property
    def peer_id(self) -> str:
        """This service's peer id (named at start unless the config gave one)."""
        return self.membership.peer_id

    @property
    def epoch(self) -> int:
        """The epoch of the service's own registration (unified; 0 for P/D roles, which SGLang
        registers)."""
        return self.membership.epoch

    @property
    def directory(self) -> DirectoryClient | None:
        """The directory client once started (none in native mode), else None."""
        return self.membership.client

    @property
    def native(self) -> bool:
        """SGLang's own NIXL P/D: no directory, the router's native mode calls SGLang directly."""
        return self.role != types_pb2.ROLE_UNIFIED and self.config.sglang.transfer_backend == "nixl"

    @property
    def sglang(self) -> SglangHttp:
        if self.http is None or self.failed:
            raise Unavailable(
                f"SGLang is not serving: {self.failed or 'starting'}", reason="PEER_UNAVAILABLE"
            )
        return self.http

    @property
    def sglang_or_none(self) -> SglangHttp | None:
        """The client while SGLang runs, else None (for stats, which answer either way)."""
        return None if self.failed else self.http

    async def start(self, handle: ServerHandle) -> dict[str, Any]:
        cfg = self.config
        self.address = f"{cfg.peer.advertise_host}:{handle.port}"
        self.membership.name(socket.gethostname(), handle.port)
        e = cfg.engine
        spec = LaunchSpec(
            role=self.role,
            model=e.model,
            port=cfg.sglang.port or free_port(),
            advertise=self.address,
            peer_id=self.peer_id,
            directory=cfg.peer.directory,
            page_size=e.page_size,
            dtype=e.dtype,
            pagestore=cfg.pagestore.address,
            transfer_timeout_seconds=cfg.handoff.transfer_timeout_seconds,
            call_sessions=cfg.peer.call_sessions,
        )
        try:
            launch = build_launch(cfg.sglang, spec)
        except InvalidArgument as err:
            # A set-up that cannot work: exit 2 naming the key, as config errors do.
            raise ConfigError([(err.metadata.get("key", "sglang"), err.message, "config")]) from None
        log.info(
            "launching sglang", argv=json.dumps([a if a != launch.api_key else "***" for a in launch.argv])
        )
        self.http = SglangHttp(launch.url, launch.api_key, cfg.sglang.request_timeout_seconds)
        self.child = SglangChild(launch)
        try:
            await self.child.start()
            await self.child.wait_healthy(self.http.session, cfg.sglang.health_timeout_seconds)
            await self._read_release()
            if not self.native:
                self.membership.connect()
            if self.role == types_pb2.ROLE_UNIFIED:
                await self._register()
        except BaseException:
            await asyncio.shield(self._close())  # never an orphan
            raise
        self._watch = asyncio.create_task(self._supervise(handle), name="sglang-supervise")
        self._probe = asyncio.create_task(self._probe_health(handle), name="sglang-health")
        info: dict[str, Any] = {
            "peer_id": self.peer_id,
            "sglang_pid": self.child.pid,
            "sglang_url": launch.url,
        }
        if self.native:
            info["bootstrap_port"] = cfg.sglang.bootstrap_port
        return info

    async def _read_release(self) -> None:
        """The salt field of the running release; a set-up it cannot isolate exits 2 naming the key."""
        cfg = self.config.sglang
        release = await self.sglang.release(cfg.health_probe_timeout_seconds)
        refused = lora_refusal(release, storage=cfg.hicache, extra_args=cfg.extra_args)
        if refused:
            raise ConfigError([("sglang.hicache", refused, "config")])
        self.salts = salt_support(release, storage=cfg.hicache)
        log.info(
            "sglang release",
            release=release or "unknown",
            salt_field=self.salts.field.value if self.salts.field is not None else "refused",
        )

    async def _register(self) -> None:
        e = self.config.engine
        if e.model is None:  # checked by build_launch
            return
        layout = await asyncio.to_thread(
            layout_from_model_dir,
            e.model,
            engine="sglang",
            engine_version="http",
            dtype=e.dtype or _model_dtype(e.model),
            page_size=e.page_size,
        )
        req = dpb.RegisterPeerRequest(
            peer_id=self.peer_id,
            role=self.role,
            address=self.address,
            layout=declare(layout.to_proto(), self.role, self.config.peer.call_sessions),
        )
        await self.membership.join(req, self._load)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Counts a request in flight (the load reported, and what a stop waits for); refuses one
        once a stop began (UNAVAILABLE: the router retries it on another peer)."""
        if self.stopping:
            raise Unavailable("the service is shutting down", reason="SHUTTING_DOWN")
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()

    def _load(self) -> dpb.PeerLoad:
        return dpb.PeerLoad(outstanding_requests=self.inflight)

    @property
    def dir(self) -> DirectoryClient:
        return self.membership.dir

    async def _supervise(self, handle: ServerHandle) -> None:
        child = self.child
        if child is None:
            return
        await child.wait_exit()
        if child.stopping:
            return
        if self._probe is not None:
            self._probe.cancel()
        self.failed = child.exit_detail()
        log.error("sglang died; the service stops (its supervisor restarts it)", detail=self.failed)
        await handle.set_serving(False)
        await self._leave_mesh()
        handle.request_stop()

    async def _probe_health(self, handle: ServerHandle) -> None:
        """NOT_SERVING after `unhealthy_after` failed probes in a row, SERVING again after one that
        passes (after a shutdown began, the health servicer ignores both)."""
        cfg = self.config.sglang
        child, http = self.child, self.http
        if child is None or http is None:
            return
        failures = 0
        serving = True
        while True:
            await asyncio.sleep(cfg.health_interval_seconds)
            ok = await child.healthy(http.session, cfg.health_probe_timeout_seconds)
            failures = 0 if ok else failures + 1
            if serving and failures >= cfg.unhealthy_after:
                serving = False
                log.warning("sglang unhealthy; not serving", failed_probes=failures)
                await handle.set_serving(False)
            elif not serving and ok:
                serving = True
                log.info("sglang healthy again; serving")
                await handle.set_serving(True)

    async def _leave_mesh(self) -> None:
        """Unregisters this service's registrations and the dead child's (found by our address), so the
        directory ends their rooms now and the router stops choosing them."""
        await self.membership.leave()
        if self.directory is None:
            return
        with contextlib.suppress(XavierError):
            for peer in await self.dir.list_peers():
                if peer.address == self.address:
                    aborted = await self.dir.unregister_peer(peer.peer_id, peer.epoch)
                    log.info("unregistered the dead sglang", peer_id=peer.peer_id, rooms_aborted=aborted)

    async def prefill_address(self, peer_id: str, epoch: int) -> str:
        """The address a prefill peer registered (a decode's SGLang finds its prefill by it)."""
        found = await self._prefills.find((peer_id, epoch))
        if found is None:
            raise NotFound(f"prefill peer {peer_id}@{epoch} is not registered", reason="PEER_NOT_FOUND")
        address: str = found.address
        return address

    async def stop(self) -> None:
        """Refuses new requests, lets those in flight finish (half the service's grace), then stops
        SGLang."""
        self.stopping = True
        for task in (self._watch, self._probe):
            if task is not None:
                task.cancel()
        if not self.failed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.config.grace_seconds / 2)
        await self.membership.leave()  # the service's own registration (unified)
        await self._close()

    async def _close(self) -> None:
        """Stops SGLang and closes the clients of it and of the directory (a stop, or a failed start)."""
        if self.child is not None:
            await self.child.stop(self.config.sglang.stop_grace_seconds)
        if self.http is not None:
            await self.http.close()
        await self.membership.close()


def _model_dtype(model: Any) -> str:
    try:
        raw = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "float16"
    name = str(raw.get("torch_dtype") or raw.get("dtype") or "float16")
    return name if name in ("float16", "bfloat16", "float32") else "float16"
