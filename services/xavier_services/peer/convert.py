"""Conversions between engine values and xavier.v1 messages."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import duration_pb2
from xavier.v1 import types_pb2

from xavier_core.engine.api import FinishReason, Sampling
from xavier_core.runtime.errors import InvalidArgument

MAX_ROOM_ID = (1 << 63) - 1
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64

_FINISH_TO_PB = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: types_pb2.FINISH_REASON_ABORT,
}


def finish_to_pb(finish: FinishReason | None) -> types_pb2.FinishReason.ValueType:
    return _FINISH_TO_PB[finish]


def sampling_from_pb(p: types_pb2.SamplingParams, default_max_tokens: int = 16) -> Sampling:
    """Validates and converts sampling parameters; errors name the field."""
    if p.temperature < 0 or p.temperature != p.temperature:
        raise InvalidArgument("sampling.temperature must be >= 0", field="sampling.temperature")
    if not 0 <= p.top_p <= 1:
        raise InvalidArgument("sampling.top_p must be in [0, 1]", field="sampling.top_p")
    if len(p.stop) > MAX_STOP_STRINGS or any(len(s) > 256 or not s for s in p.stop):
        raise InvalidArgument(
            f"sampling.stop takes at most {MAX_STOP_STRINGS} non-empty strings of <= 256 chars",
            field="sampling.stop",
        )
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument("too many sampling.stop_token_ids", field="sampling.stop_token_ids")
    return Sampling(
        max_tokens=p.max_tokens or default_max_tokens,
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def check_room_id(room_id: int) -> None:
    if not 1 <= room_id <= MAX_ROOM_ID:
        raise InvalidArgument(f"room_id must be in 1..2^63-1, got {room_id}", field="room_id")


def check_prompt(token_ids: Sequence[int], max_context: int, vocab_size: int) -> None:
    if not token_ids:
        raise InvalidArgument("token_ids is empty", field="token_ids")
    if len(token_ids) >= max_context:
        raise InvalidArgument(
            f"prompt of {len(token_ids)} tokens leaves no room in the {max_context}-token context",
            field="token_ids",
        )
    if max(token_ids) >= vocab_size:
        raise InvalidArgument(f"token id {max(token_ids)} >= vocab size {vocab_size}", field="token_ids")


def seconds(value: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(value * 1e9))
    return d
