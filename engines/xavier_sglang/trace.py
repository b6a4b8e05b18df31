"""Per-room timestamps for benchmarks: where one request's handoff spends its time, on each side.

Off unless `XAVIER_SGLANG_TRACE` names a directory. Then every room, when SGLang clears it, appends one
JSON line to `<dir>/<side>-<pid>.jsonl`: the room id, the side (`prefill` / `decode`), how many times
SGLang polled it, its outcome and the wall-clock time of each step it passed (`time.time()`, so the
prefill's and the decode's lines of one room, written by two processes of one host, line up).
`benchmarks/sglang_pd.py` joins them into a breakdown. Nothing is written on the request path but
this one line, and nothing at all when the variable is unset. The HiCache storage backend appends one
line per storage call the same way (`storage_call`), so a warm read's time splits into its lookup, its
get and what SGLang does around them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO

__all__ = ["ENV_TRACE", "RoomTrace", "storage_call", "tracing"]

ENV_TRACE = "XAVIER_SGLANG_TRACE"

_lock = threading.Lock()
_files: dict[str, IO[str]] = {}


def _sink(side: str) -> IO[str] | None:
    folder = os.environ.get(ENV_TRACE)
    if not folder:
        return None
    with _lock:
        out = _files.get(side)
        if out is None:
            os.makedirs(folder, exist_ok=True)
            out = open(os.path.join(folder, f"{side}-{os.getpid()}.jsonl"), "a", buffering=1)
            _files[side] = out
        return out


class RoomTrace:
    """The steps of one room on one side; `mark` keeps the first time of each step."""

    __slots__ = ("_on", "polls", "room", "side", "steps")

    def __init__(self, side: str, room: int) -> None:
        self._on = bool(os.environ.get(ENV_TRACE))
        self.side = side
        self.room = room
        self.polls = 0
        self.steps: dict[str, float] = {}
        self.mark("created")

    def mark(self, step: str) -> None:
        if self._on and step not in self.steps:
            self.steps[step] = time.time()

    def write(self, outcome: str) -> None:
        """Appends the room's line once (later calls do nothing)."""
        if not self._on:
            return
        self._on = False
        out = _sink(self.side)
        if out is None:
            return
        line = {
            "room": self.room,
            "side": self.side,
            "outcome": outcome,
            "polls": self.polls,
            "t": self.steps,
        }
        with _lock:
            out.write(json.dumps(line, separators=(",", ":")) + "\n")


def tracing() -> bool:
    return bool(os.environ.get(ENV_TRACE))


def storage_call(
    op: str, pages: int, start: float, hit: int, steps: dict[str, float] | None = None, **facts: object
) -> None:
    """Appends one HiCache storage call's line (`<dir>/hicache-<pid>.jsonl`): the operation (exists, get),
    the pages asked and found, its wall-clock start and end and, for a get, the seconds of each step of
    its fetch (`xavier_pagestore_client_fetch_seconds`) and `facts` (how it read and checked); nothing
    when tracing is off."""
    out = _sink("hicache") if tracing() else None
    if out is None:
        return
    line: dict[str, object] = {"op": op, "pages": pages, "hit": hit, "t0": start, "t1": time.time()}
    if steps:
        line["steps_ms"] = {k: round(1e3 * v, 3) for k, v in steps.items()}
    line.update(facts)
    with _lock:
        out.write(json.dumps(line, separators=(",", ":")) + "\n")
