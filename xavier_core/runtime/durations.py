"""Seconds as floats <-> `google.protobuf.Duration`, the one conversion every service and client uses."""

from __future__ import annotations

from google.protobuf import duration_pb2

__all__ = ["to_duration", "to_seconds"]


def to_duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds`, rounded to the nearest nanosecond."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def to_seconds(d: duration_pb2.Duration) -> float:
    """The seconds a Duration holds (an unset Duration is 0)."""
    return d.seconds + d.nanos / 1e9
