"""The directory's commands in the etcd log: each round-trips, and the stored form stays the positional
list older directories write and read (so a mixed-version pair of replicas agrees)."""

from __future__ import annotations

import json

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.directory import commands as c
from xavier_services.directory.etcd_commands import Entry, command_from_args, decode_entry, encode_entry
from xavier_services.directory.state import Pair

PAIR = Pair("p", 3, "d", 4)
EVERY: list[c.Command[object]] = [
    c.Register("r1", "", types_pb2.ROLE_PREFILL, "a:1", types_pb2.KvLayout(page_size=16), None, "peer-x"),
    c.Heartbeat("r2", "p", 3, dpb.PeerLoad(outstanding_requests=2)),
    c.Unregister("p", 3),
    c.Publish("r3", 7, PAIR, dpb.SourceDescriptor(read_token=b"t")),
    c.Join(7, PAIR),
    c.Begin("r4", 7, "d", 4),
    c.Complete("r5", 7, "d", 4),
    c.Abort("r6", 7, dpb.ROOM_END_CAUSE_ROUTER_ABORT, "why", "", 0),
    c.Sweep(),
]


@pytest.mark.parametrize("command", EVERY, ids=lambda c: c.op)
def test_every_command_round_trips(command: c.Command[object]) -> None:
    entry = Entry(command, 12.5, "proposer", 9)
    assert decode_entry(encode_entry(entry)) == entry


def test_the_stored_form_is_the_positional_list() -> None:
    stored = json.loads(encode_entry(Entry(c.Join(7, PAIR), 1.0, "s", 2)))
    assert stored == {"op": "join", "t": 1.0, "src": "s", "n": 2, "a": [7, "p", 3, "d", 4]}
    # An older directory's register carries the new id last; one without it takes the default.
    assert command_from_args("register", ["r", "p", 1, "a:1", None, None]) == c.Register(
        "r", "p", 1, "a:1", None, None
    )


@pytest.mark.parametrize(
    ("op", "args"),
    [("begin", ["r", "7", "d", 4]), ("unregister", ["p"]), ("sweep", [1]), ("nope", [])],
)
def test_a_malformed_entry_is_unreadable(op: str, args: list[object]) -> None:
    with pytest.raises((TypeError, ValueError)):
        command_from_args(op, args)
