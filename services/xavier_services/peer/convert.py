"""Conversions between engine values and xavier.v1 messages."""

from __future__ import annotations

from collections.abc import Sequence

from xavier.v1 import types_pb2

from xavier_core.engine.api import (
    EngineFeature,
    FinishReason,
    PromptLogprobs,
    Sampling,
    TopLogprobs,
)
from xavier_core.grammar.wire import grammar_from_pb
from xavier_core.runtime.errors import InvalidArgument

MAX_ROOM_ID = (1 << 63) - 1

_FINISH_TO_PB = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: types_pb2.FINISH_REASON_ABORT,
}


_FEATURE_TO_PB = {
    EngineFeature.TOP_LOGPROBS: types_pb2.ENGINE_FEATURE_TOP_LOGPROBS,
    EngineFeature.PROMPT_LOGPROBS: types_pb2.ENGINE_FEATURE_PROMPT_LOGPROBS,
    EngineFeature.STRUCTURED_OUTPUT: types_pb2.ENGINE_FEATURE_STRUCTURED_OUTPUT,
    EngineFeature.PENALTIES: types_pb2.ENGINE_FEATURE_PENALTIES,
    EngineFeature.LOGIT_BIAS: types_pb2.ENGINE_FEATURE_LOGIT_BIAS,
    EngineFeature.MIN_TOKENS: types_pb2.ENGINE_FEATURE_MIN_TOKENS,
    EngineFeature.MIN_P: types_pb2.ENGINE_FEATURE_MIN_P,
    EngineFeature.STOP_STRING_IN_OUTPUT: types_pb2.ENGINE_FEATURE_STOP_STRING_IN_OUTPUT,
    EngineFeature.RESUMED_OUTPUT: types_pb2.ENGINE_FEATURE_RESUMED_OUTPUT,
}


def features_pb(features: frozenset[EngineFeature]) -> list[types_pb2.EngineFeature.ValueType]:
    """An engine's features as `KvLayout.features` lists them (in declaration order)."""
    return [pb for feature, pb in _FEATURE_TO_PB.items() if feature in features]


def top_pb(top: TopLogprobs | None) -> types_pb2.TopLogprobs | None:
    """The wire form of one position's alternatives (None when none were asked for)."""
    if top is None:
        return None
    return types_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def prompt_logprobs_pb(prompt: PromptLogprobs) -> types_pb2.PromptLogprobs:
    """The wire form of a prompt's logprobs."""
    return types_pb2.PromptLogprobs(
        logprobs=prompt.logprobs,
        top_logprobs=[types_pb2.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs) for t in prompt.top],
    )


def finish_to_pb(finish: FinishReason | None) -> types_pb2.FinishReason.ValueType:
    return _FINISH_TO_PB[finish]


def usage_pb(
    prompt_tokens: int, cached: int, cached_store: int, completion_tokens: int = 0
) -> types_pb2.Usage:
    """Token counts; `cached` prompt tokens were not computed, `cached_store` of them came from the page
    store and the rest from the local prefix cache."""
    return types_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
        cached_tokens_local=cached - cached_store,
        cached_tokens_store=cached_store,
    )


def sampling_from_pb(p: types_pb2.SamplingParams, default_max_tokens: int = 16) -> Sampling:
    """Converts sampling parameters (0 max_tokens: the default; 0 top_p and 0 repetition_penalty: off)
    and checks them against the
    shared limits: a `SamplingError` naming the field reaches the client as INVALID_ARGUMENT."""
    sampling = Sampling(
        max_tokens=p.max_tokens or default_max_tokens,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        top_logprobs=p.top_logprobs,
        prompt_logprobs=p.prompt_logprobs,
        grammar=grammar_from_pb(p),
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_tokens=p.min_tokens,
        min_p=p.min_p,
        include_stop_str_in_output=p.include_stop_str_in_output,
        resumed_output_tokens=p.resumed_output_tokens,
    )
    sampling.check()
    return sampling


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
