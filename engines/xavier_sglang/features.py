"""The request features (`KvLayout.features`) an SGLang peer declares: what SGLang's `/generate` honours
as Xavier defines it, in every supported release (0.5.17 … 0.5.23), through the body the hosting service
builds (`xavier_services.sglang_host.protocol`).

Both roles of a P/D pair declare the same set, since the router checks each (a feature one role ignores
is still passed to it: the prefill samples the first token under the grammar, the penalties, the bias,
min_p and min_new_tokens; the decode replays that token into its grammar matcher and counts it in its
penalizers, `disaggregation/decode_schedule_batch_mixin.py` `process_prebuilt` and
`ScheduleBatch.prepare_for_decode`).

A pair declares the logprob features as a unified server does, each from where SGLang has it:
- Top logprobs: the decode streams every token's alternatives, the first token's included. The prefill
  samples that token and computes its `top_logprobs_num` alternatives with it; `MetadataBuffers.set_buf`
  puts them in the request's aux slot (room for 128; Xavier asks 20 at most), which the xavier backend
  hands over whole, and the decode's `_commit_transfer_to_req` appends them to its output logprobs
  (`disaggregation/utils.py`, `disaggregation/decode.py`, both releases).
- Prompt logprobs: only the prefill computes the prompt. With `logprob_start_len` 0 its
  `process_batch_result_disagg_prefill` records the input logprobs (`add_logprob_return_values`, and
  `add_input_logprob_return_values` per chunk), and its output streamer sends them in every mode but
  the decode's (`scheduler_components/output_streamer.py`), so the prefill's `/generate` answer holds
  `input_token_logprobs` as a unified server's does. The hosting service returns them in
  `PrefillResponse.prompt_logprobs`; the router's concurrent pair path puts them on the first step.

Not declared, so refused by the router: `repetition_penalty` (SGLang's counts the output only and stops
at 2, Xavier's counts the prompt too).
"""

from __future__ import annotations

from xavier.v1 import types_pb2

__all__ = ["PAIR_FEATURES", "UNIFIED_FEATURES", "declare", "features_for"]

PAIR_FEATURES: tuple[types_pb2.EngineFeature.ValueType, ...] = (
    types_pb2.ENGINE_FEATURE_TOP_LOGPROBS,
    types_pb2.ENGINE_FEATURE_PROMPT_LOGPROBS,
    types_pb2.ENGINE_FEATURE_STRUCTURED_OUTPUT,
    types_pb2.ENGINE_FEATURE_LOGIT_BIAS,
    types_pb2.ENGINE_FEATURE_MIN_TOKENS,
    types_pb2.ENGINE_FEATURE_MIN_P,
    types_pb2.ENGINE_FEATURE_STOP_STRING_IN_OUTPUT,
    types_pb2.ENGINE_FEATURE_OUTPUT_PENALTIES,
)
"""What an SGLang prefill and decode declare."""

UNIFIED_FEATURES: tuple[types_pb2.EngineFeature.ValueType, ...] = PAIR_FEATURES
"""What a unified SGLang server declares: the same as a pair."""


def features_for(role: types_pb2.Role.ValueType) -> tuple[types_pb2.EngineFeature.ValueType, ...]:
    """The features an SGLang peer of `role` declares."""
    return UNIFIED_FEATURES if role == types_pb2.ROLE_UNIFIED else PAIR_FEATURES


def declare(
    layout: types_pb2.KvLayout, role: types_pb2.Role.ValueType, call_sessions: bool = True
) -> types_pb2.KvLayout:
    """`layout` with what an SGLang peer of `role` declares: its features and, for a P/D role, how it
    hands off (the prefill and decode are called at once: SGLang's own bootstrap pairs them), where
    the first token comes from (the decode streams it) and, with `call_sessions`, that its hosting
    service serves call sessions. Returns `layout`, changed in place."""
    layout.features.extend(features_for(role))
    if role in (types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE):
        layout.handoff = types_pb2.HANDOFF_PROTOCOL_CONCURRENT
        layout.first_token_source = types_pb2.FIRST_TOKEN_SOURCE_DECODE
        if call_sessions:
            layout.service_features.append(types_pb2.SERVICE_FEATURE_CALL_SESSIONS)
    return layout
