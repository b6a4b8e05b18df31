"""A prefill's hold of a pair handoff's source, in process over a port and an engine of its own making:
the reader's word, the router's and the prefill's stop each end its wait for the reader."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace

from xavier.v1 import prefill_service_pb2 as pb
from xavier_services.prefill.servicer import PrefillServicer, _Hold

from xavier_core.transfer import ReadEnd

_ROOM = 7


@dataclass
class _Port:
    """The source side of a port: one published room, whose reader's word comes when `word` is set."""

    word: ReadEnd = ReadEnd.NONE
    heard: asyncio.Event = field(default_factory=asyncio.Event)
    unpublished: list[tuple[int, bool]] = field(default_factory=list)

    def tell(self, word: ReadEnd) -> None:
        self.word = word
        self.heard.set()

    async def wait_read_end(self, room_id: int, timeout: float) -> ReadEnd:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.heard.wait(), timeout)
        return self.word

    def read_ended(self, room_id: int) -> bool:
        return self.heard.is_set()

    async def unpublish(self, room_id: int, completed: bool) -> None:
        self.unpublished.append((room_id, completed))


@dataclass
class _Engine:
    released: list[str] = field(default_factory=list)

    async def abort(self, request_id: str) -> None:
        pass

    def release_pages(self, request_id: str) -> None:
        self.released.append(request_id)


async def _end_rooms(rooms: list[int], why: str, quiet: asyncio.Event) -> bool:
    await quiet.wait()
    return True


def _holding(park_timeout: float = 30.0) -> tuple[PrefillServicer, _Hold, _Port, _Engine]:
    """A servicer holding one pair source (room `_ROOM`) whose hold waits for its reader's word."""
    port, engine = _Port(), _Engine()
    handoff = SimpleNamespace(room_lease_seconds=30.0, park_timeout_seconds=park_timeout)
    servicer = PrefillServicer.__new__(PrefillServicer)
    servicer.host = SimpleNamespace(  # type: ignore[assignment]
        port=port, engine=engine, config=SimpleNamespace(handoff=handoff), end_rooms=_end_rooms
    )
    servicer._holds, servicer._no_holds, servicer._draining = {}, asyncio.Event(), False
    hold = _Hold(_ROOM, f"prefill-{_ROOM}", pages=3)
    hold.released = asyncio.get_running_loop().create_future()
    servicer._holds[_ROOM] = hold
    hold.task = asyncio.get_running_loop().create_task(servicer._hold_pair(hold))
    return servicer, hold, port, engine


async def _ended(servicer: PrefillServicer, hold: _Hold) -> None:
    assert hold.task is not None
    await asyncio.wait_for(hold.task, 2)
    assert not servicer._holds and servicer._no_holds.is_set()


async def test_the_readers_done_unpins_the_source_as_a_completed_transfer() -> None:
    servicer, hold, port, engine = _holding()
    await asyncio.sleep(0.01)
    port.tell(ReadEnd.DONE)
    await _ended(servicer, hold)
    assert port.unpublished == [(_ROOM, True)] and engine.released == [f"prefill-{_ROOM}"]


async def test_the_routers_release_without_a_decode_unpins_at_once_and_with_one_parks() -> None:
    servicer, hold, port, engine = _holding()
    await asyncio.sleep(0.01)  # the hold waits for the reader's word
    answer = await servicer.ReleaseSource(pb.ReleaseSourceRequest(room_id=_ROOM, decode_called=False), None)
    assert answer.held
    await _ended(servicer, hold)
    assert port.unpublished == [(_ROOM, False)] and engine.released == [f"prefill-{_ROOM}"]

    servicer, hold, port, engine = _holding()
    await asyncio.sleep(0.01)
    await servicer.ReleaseSource(pb.ReleaseSourceRequest(room_id=_ROOM, decode_called=True), None)
    await asyncio.sleep(0.01)
    assert hold.parked and not port.unpublished  # a read may run: the pages wait for its end
    port.tell(ReadEnd.DONE)
    await _ended(servicer, hold)
    assert port.unpublished == [(_ROOM, False)]


async def test_a_release_before_the_hold_waits_is_heard_too() -> None:
    servicer, hold, port, _ = _holding()
    assert hold.released is not None
    hold.released.set_result(False)  # before the hold's task first ran
    await _ended(servicer, hold)
    assert port.unpublished == [(_ROOM, False)]


async def test_the_prefills_stop_unpins_a_held_source_at_once() -> None:
    servicer, hold, port, engine = _holding()
    await asyncio.sleep(0.01)
    await asyncio.wait_for(servicer.drain(), 2)
    await _ended(servicer, hold)
    assert port.unpublished == [(_ROOM, False)] and engine.released == [f"prefill-{_ROOM}"]
