"""A fake clock and a directory state wired to it."""

from __future__ import annotations

from typing import Any

from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.records import RoomRecord
from xavier_services.directory.state import DirectoryState

WALL_BASE = 1_800_000_000.0


class FakeClock:
    """Monotonic seconds that move only when told."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_state(clock: FakeClock, **settings: Any) -> tuple[DirectoryState, list[tuple[int, int]]]:
    """A state on ``clock``; the list collects (room_id, new state) changes."""
    changes: list[tuple[int, int]] = []

    def listener(room: RoomRecord) -> None:
        changes.append((room.room_id, room.state))

    state = DirectoryState(
        DirectorySettings(**settings),
        clock=clock,
        wall=lambda: clock() + WALL_BASE,
        listener=listener,
    )
    return state, changes
