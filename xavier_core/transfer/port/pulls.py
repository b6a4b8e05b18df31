"""How a reader pulls a room over each transport, on a `PortCore`: NIXL page runs, a CUDA IPC copy, or
staged slab chunks. `KvPort.pull` picks one and counts it.

Every pull keeps invariant I1 the same way: once anything is posted, a cancel or a timeout waits (bounded
by `park_timeout`) until nothing can touch the pages or slab chunks any more before it returns, so the
caller may free them; the engine loop never waits, since the work is polled on the NIXL thread. A read
still running at the park timeout is said apart: the pull raises `ReadStuck` (a cancelled one stays
cancelled) and the port remembers the room (`PortCore.stuck_rooms`), so the caller keeps the pages out of
use instead of freeing them, until the read has ended (the room's future, asked every `REAP_POLL_S`). And
the
source always learns how the read ended (a NIXL notification with its read token), or that no read
will come (`decline`), so it unpins at once instead of at its park timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from xavier.v1 import types_pb2

from xavier_core.runtime.errors import Unavailable
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer.common.errors import TransferError
from xavier_core.transfer.common.peers import split_peer_key
from xavier_core.transfer.common.runs import Mode
from xavier_core.transfer.common.source import SourceInfo
from xavier_core.transfer.common.stuck import poll_until
from xavier_core.transfer.nixl.rooms import KvPoll, KvReceiver, fail_notif
from xavier_core.transfer.port.core import IpcCopy, PortCore
from xavier_core.transfer.staged.read import PIPELINE_DEPTH, StagedRead
from xavier_core.transfer.staged.slab import I64, Slab, View

if TYPE_CHECKING:
    from xavier_core.transfer.cuda.copy_plan import PoolView
    from xavier_core.transfer.port.transport import IpcPeers

log = get_logger(__name__)


class ReadStuck(Unavailable):
    """A pull that failed while its read was still running at the park timeout: the destination pages may
    still change, so they are never to be used again."""

    def __init__(self, room_id: int, what: str) -> None:
        super().__init__(
            f"KV {what} of room {room_id} still in flight after the park timeout", reason="TRANSFER_STUCK"
        )


def _stuck(
    core: PortCore, exc: BaseException, room_id: int, what: str, ended: Callable[[], Awaitable[object]]
) -> None:
    """After a failed pull whose read did not end: remembered on the port until `ended()` returns (the
    read can no longer touch the pages), and raised as `ReadStuck` in place of an error (a cancellation
    goes on as one)."""
    log.error(f"KV {what} still running after the park timeout", room=room_id)
    core.reap(room_id, ended)
    if isinstance(exc, Exception):
        raise ReadStuck(room_id, what) from exc


async def _idle_at_last(core: PortCore, receiver: KvReceiver) -> None:
    """Returns once a stuck NIXL read has ended, asking every `REAP_POLL_S`; forgets the receiver."""
    await poll_until(lambda: core.run(receiver.wait_idle, 0.0))
    await core.run(receiver.clear)


async def decline(
    core: PortCore, room_id: int, read_token: str, endpoint: types_pb2.TransferEndpoint, peer: str
) -> None:
    """Tells a room's source that no read will come (the room began, the read never started)."""

    def _send() -> None:
        try:
            core.agent.add_peer(peer, endpoint.agent_metadata)
            core.agent.notify_read_end(peer, fail_notif(str(room_id), read_token))
            core.flush_notifs()
        except TransferError as err:
            log.info("decline not delivered", room_id=room_id, error=str(err))

    await core.run(_send)


async def _settle(room_id: int, done: asyncio.Future[KvPoll], timeout: float, what: str) -> None:
    """Waits for a posted read's outcome; `Unavailable` unless it succeeded within `timeout`."""
    try:
        async with asyncio.timeout(timeout):  # a timer on this task, not a waiter future of wait_for's
            state = await asyncio.shield(done)
    except TimeoutError:
        state = KvPoll.FAILED
    if state != KvPoll.SUCCESS:
        raise Unavailable(f"KV {what} of room {room_id} failed ({state.name})", reason="TRANSFER_FAILED")


async def _park(done: asyncio.Future[KvPoll], park_timeout: float) -> bool:
    """Whether a posted copy or read ended within the park timeout."""
    try:
        await asyncio.shield(asyncio.wait_for(asyncio.shield(done), park_timeout))
    except TimeoutError:
        return False
    return True


async def pull_ipc(
    core: PortCore,
    ipc: IpcPeers,
    room_id: int,
    info: SourceInfo,
    endpoint: types_pb2.TransferEndpoint,
    peer: str,
    view: PoolView,
    pages: tuple[I64, I64],
    timeout: float,
    park_timeout: float,
    silent: bool = False,
) -> None:
    """One fused copy from the mapped source pool; its end is told to the source only once the copy's
    CUDA event has completed, so the source's pages stay pinned until then (I1). `silent`: nothing is
    told (a standing source, `KvPort.pull`)."""
    peer_id = (split_peer_key(peer) or (peer, 0))[0]
    loop = asyncio.get_running_loop()
    copy = IpcCopy(str(room_id), info.token, peer, loop.create_future(), tell=not silent)
    posted = False

    def _start() -> None:
        nonlocal posted
        if not silent:
            core.agent.add_peer(peer, endpoint.agent_metadata)  # the read-end notification goes over NIXL
        handle = ipc.pull(peer_id, view, *pages)
        core._copies[handle] = copy
        posted = True  # from here the copy's end tells the source (even if this task is cancelled)

    def _abort() -> None:
        copy.aborted = True  # its end is reported to the source as a failed read

    try:
        try:
            await core.run(_start)
        except TransferError as err:
            raise Unavailable(
                f"KV copy of room {room_id} not started: {err}", reason="TRANSFER_FAILED"
            ) from None
        await _settle(room_id, copy.done, timeout, "copy")
    except BaseException as exc:
        # Queued behind `_start` on the NIXL thread, so `posted` is final once this returns.
        await asyncio.shield(core.run(_abort))
        if not posted:
            if not silent:
                await asyncio.shield(decline(core, room_id, info.token, endpoint, peer))
        elif not await _park(copy.done, park_timeout):
            _stuck(core, exc, room_id, "copy", lambda: asyncio.shield(copy.done))
        raise


async def pull_nixl(
    core: PortCore,
    mode: Mode,
    room_id: int,
    info: SourceInfo,
    endpoint: types_pb2.TransferEndpoint,
    peer: str,
    dest_pages: Sequence[int],
    timeout: float,
    park_timeout: float,
    silent: bool = False,
) -> None:
    """One NIXL READ of the source's page runs (one descriptor per run per buffer, or per page);
    `silent`: the source is told nothing (`KvReceiver.silent`)."""
    receiver = KvReceiver(core.manager, str(room_id))
    receiver.silent = silent
    done: asyncio.Future[KvPoll] = asyncio.get_running_loop().create_future()
    posted = False

    def _start() -> bool:
        nonlocal posted
        receiver.init()
        receiver.send_metadata(list(dest_pages))
        receiver.start(info, peer, mode)
        posted = True  # from here the receiver tells the source how its read ended
        if receiver.poll() == KvPoll.SUCCESS:  # ended inside the post (a one-sided copy): no tick needed
            receiver.clear()
            core.flush_notifs()  # but its "done" moves only while the thread polls (`PortCore._tick`)
            return True
        core._reads[receiver] = done
        return False

    def _forget() -> None:
        core._reads.pop(receiver, None)

    try:
        if await core.run(_start):
            return
        await _settle(room_id, done, timeout, "read")
    except BaseException as exc:
        await asyncio.shield(core.run(_forget))
        if not posted and not silent:
            await asyncio.shield(decline(core, room_id, info.token, endpoint, peer))
        if not await asyncio.shield(_quiesce(core, receiver, park_timeout)):
            _stuck(core, exc, room_id, "read", lambda: _idle_at_last(core, receiver))
        raise
    # A read that succeeded was cleared on the NIXL thread when its end was seen (`PortCore._tick`).


async def _quiesce(core: PortCore, receiver: KvReceiver, timeout: float) -> bool:
    """Aborts a receiver and waits until its read can no longer touch the destination pages; False when
    it still could at `timeout`."""
    await core.run(receiver.abort)
    await core.run(core.flush_notifs)  # its "fail" leaves now or once the read ends
    deadline = time.monotonic() + timeout
    while not await core.run(receiver.wait_idle, 0.05):
        if time.monotonic() > deadline:
            return False
    await core.run(receiver.clear)
    return True


async def pull_staged(
    core: PortCore,
    slab: Slab,
    pool: View,
    room_id: int,
    info: SourceInfo,
    endpoint: types_pb2.TransferEndpoint,
    peer: str,
    dest_pages: I64,
    timeout: float,
    park_timeout: float,
) -> bool:
    """Pulls the source's slab chunks through a ring of local chunks, scattering each as it lands.
    False, with nothing posted and nothing told to the source, when this slab has no free chunk: the
    caller reads the page runs instead."""
    remote, remote_layout = info.staging_slab()
    src_chunks = info.staging_chunks()
    done: asyncio.Future[KvPoll] = asyncio.get_running_loop().create_future()
    read: StagedRead | None = None

    def _start() -> bool:
        nonlocal read
        core.agent.add_peer(peer, info.metadata)
        ring = None
        for depth in range(min(PIPELINE_DEPTH, src_chunks.size), 0, -1):
            # A shallower ring still takes the staged path: only no chunk at all counts a fallback.
            ring = slab.alloc(depth) if depth == 1 else _try_alloc(slab, depth)
            if ring is not None:
                break
        if ring is None:
            return False
        try:
            read = StagedRead(
                core.agent, slab, pool, peer, remote, remote_layout, src_chunks, dest_pages,
                ring, str(room_id), info.token, timeout,
            )  # fmt: skip
        except BaseException:
            slab.free(ring)  # refused before anything was posted: the ring was never used
            raise
        core._staged[read] = done
        read.start()  # from here the read's end tells the source (even if this task is cancelled)
        return True

    def _abort() -> None:
        if read is not None:
            read.abort()

    try:
        if not await core.run(_start):
            return False
        await _settle(room_id, done, timeout, "staged read")
    except BaseException as exc:
        # Queued behind `_start` on the NIXL thread, so `read` is final once this returns.
        await asyncio.shield(core.run(_abort))
        if read is None:
            await asyncio.shield(decline(core, room_id, info.token, endpoint, peer))
            if isinstance(exc, TransferError):
                raise Unavailable(
                    f"KV staged read of room {room_id} not started: {exc}", reason="TRANSFER_FAILED"
                ) from None
            raise
        if not await _park(done, park_timeout):
            _stuck(core, exc, room_id, "staged read", lambda: asyncio.shield(done))
        raise
    return True


def _try_alloc(slab: Slab, n: int) -> list[int] | None:
    """`n` chunks if that many are free, else None without counting a fallback."""
    if slab.chunks_in_use + n > slab.layout.num_chunks:
        return None
    return slab.alloc(n)
