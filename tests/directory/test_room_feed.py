"""RoomFeed's synchronous face: the latest message of a room, as the stream or an RPC's answer showed it
(what the SGLang hub's scheduler-side calls read), with a terminal state final."""

from __future__ import annotations

from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.directory.room_feed import RoomFeed


def _room(room_id: int, state: int, **fields: object) -> dpb.Room:
    return dpb.Room(room_id=room_id, state=state, **fields)  # type: ignore[arg-type]


def test_latest_is_the_last_message_and_a_terminal_one_is_final() -> None:
    feed = RoomFeed(None, lambda: ("p", 1))  # type: ignore[arg-type]  # no stream: apply() only
    assert feed.latest(7) is None
    feed.apply(_room(7, dpb.ROOM_STATE_OPEN, decode_peer_id="d", decode_epoch=3))
    got = feed.latest(7)
    assert got is not None and (got.decode_peer_id, got.decode_epoch) == ("d", 3)
    ended = _room(7, dpb.ROOM_STATE_ABORTED, end_cause=dpb.ROOM_END_CAUSE_PEER_LOST, end_detail="gone")
    feed.apply(ended)
    feed.apply(_room(7, dpb.ROOM_STATE_SOURCE_READY))  # a late answer never revives an ended room
    assert feed.latest(7) == ended
    assert feed.latest(8) is None  # reading never creates a view
    feed.forget(7)
    assert feed.latest(7) is None
