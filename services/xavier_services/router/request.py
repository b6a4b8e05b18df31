"""A validated request: token ids, sampling and mode, ready for a routing flow."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2

from xavier_core.grammar.wire import grammar_from_pb
from xavier_core.runtime import InvalidArgument
from xavier_core.runtime.domain_errors import sampling_status
from xavier_core.sampling import SamplingError, check_cache_salt, check_sampling
from xavier_services.router.chat_tools import chat_message, chat_tool
from xavier_services.router.prompts import ModelInfo, PromptEncoder


@dataclass
class Prepared:
    """One request after tokenization and validation."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: types_pb2.SamplingParams
    mode: int
    cache_salt: str
    arrival: float = field(default_factory=time.monotonic)
    prompt_text: str | None = None  # the prompt as the client wrote it, for a text prompt (OpenAI `echo`)
    migration: bool = True  # may move to another pair when its decode fails mid-stream (`migration`)


def check_sampling_pb(s: types_pb2.SamplingParams) -> None:
    """The shared sampling limits over a SamplingParams as the wire reads it (top_p 0 and
    repetition_penalty 0: off); raises
    INVALID_ARGUMENT naming the field (`field` metadata)."""
    try:
        check_sampling(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
            top_logprobs=s.top_logprobs,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty or 1.0,
            logit_bias=dict(s.logit_bias),
            min_tokens=s.min_tokens,
            min_p=s.min_p,
        )
        grammar = grammar_from_pb(s)
        if grammar is not None:
            grammar.check()
    except SamplingError as err:
        raise sampling_status(err) from None
    if s.min_tokens and s.WhichOneof("grammar") is not None:
        # A grammar may allow nothing but its end before min_tokens: nothing would be left to sample.
        raise InvalidArgument(
            "min_tokens cannot be combined with a grammar",
            reason="UNSUPPORTED_PARAMETER",
            field="min_tokens",
            param="min_tokens",
        )
    if s.top_logprobs and not s.logprobs:
        raise InvalidArgument(
            "top_logprobs needs logprobs",
            reason="INVALID_SAMPLING",
            field="top_logprobs",
            param="top_logprobs",
        )


def needed_features(s: types_pb2.SamplingParams) -> list[tuple[types_pb2.EngineFeature.ValueType, str]]:
    """The engine features a request's sampling needs (`KvLayout.features`), each with the sampling
    field that needs it, the prompt's first: an echo that would fail is named as the echo."""
    f = types_pb2
    needs = []
    if s.prompt_logprobs:
        needs.append((f.ENGINE_FEATURE_PROMPT_LOGPROBS, "prompt_logprobs"))
    if s.top_logprobs:
        needs.append((f.ENGINE_FEATURE_TOP_LOGPROBS, "top_logprobs"))
    if grammar_from_pb(s) is not None:
        needs.append((f.ENGINE_FEATURE_STRUCTURED_OUTPUT, "grammar"))
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(s, name):
            needs.append((f.ENGINE_FEATURE_OUTPUT_PENALTIES, name))
    if s.repetition_penalty not in (0.0, 1.0):
        needs.append((f.ENGINE_FEATURE_PENALTIES, "repetition_penalty"))
    if s.logit_bias:
        needs.append((f.ENGINE_FEATURE_LOGIT_BIAS, "logit_bias"))
    if s.min_tokens:
        needs.append((f.ENGINE_FEATURE_MIN_TOKENS, "min_tokens"))
    if s.min_p:
        needs.append((f.ENGINE_FEATURE_MIN_P, "min_p"))
    if s.include_stop_str_in_output:
        needs.append((f.ENGINE_FEATURE_STOP_STRING_IN_OUTPUT, "include_stop_str_in_output"))
    if s.resumed_output_tokens and (s.presence_penalty or s.frequency_penalty or grammar_from_pb(s)):
        # Only these read which tokens are output; max_tokens and min_tokens are lowered by the router.
        needs.append((f.ENGINE_FEATURE_RESUMED_OUTPUT, "resumed_output_tokens"))
    return needs


def _declared(layout: types_pb2.KvLayout | None) -> set[types_pb2.EngineFeature.ValueType]:
    """What an engine declares (`layout` None: nothing), ENGINE_FEATURE_PENALTIES covering the
    output-only two."""
    have = set(layout.features) if layout is not None else set()
    if types_pb2.ENGINE_FEATURE_PENALTIES in have:
        have.add(types_pb2.ENGINE_FEATURE_OUTPUT_PENALTIES)
    return have


def serves(prep: Prepared) -> Callable[[dpb.Peer], bool] | None:
    """A predicate that tells the peers whose engines declare every feature `prep` needs (for the
    router's pick to prefer them); None when it needs none."""
    needs = {feature for feature, _ in needed_features(prep.sampling)}
    if not needs:
        return None
    return lambda peer: needs <= _declared(peer.layout)


def require_features(prep: Prepared, layout: types_pb2.KvLayout | None, who: str) -> None:
    """Refuses (INVALID_ARGUMENT, UNSUPPORTED_PARAMETER naming the sampling field) a request that needs
    a feature the chosen engine does not declare; `layout` None: an engine that declares none."""
    have = _declared(layout)
    for feature, param in needed_features(prep.sampling):
        if feature not in have:
            raise InvalidArgument(
                f"{param} is not supported by the {who} engine that would serve this request",
                reason="UNSUPPORTED_PARAMETER",
                field=f"sampling.{param}",
                param=param,
            )


def _check_sampling(s: types_pb2.SamplingParams, prompt_len: int, model: ModelInfo) -> None:
    check_sampling_pb(s)
    if model.vocab_size and any(t >= model.vocab_size for t in s.logit_bias):
        raise InvalidArgument(
            f"logit_bias token ids must be below the vocabulary size {model.vocab_size}",
            reason="INVALID_SAMPLING",
            field="logit_bias",
            param="logit_bias",
        )
    if prompt_len + s.max_tokens > model.max_context:
        raise InvalidArgument(
            f"prompt ({prompt_len} tokens) + max_tokens ({s.max_tokens}) exceeds the context limit "
            f"of {model.max_context} tokens",
            reason="MAX_TOKENS_TOO_LARGE",
            param="max_tokens",
            max_tokens=s.max_tokens,
            prompt_tokens=prompt_len,
            max_context=model.max_context,
        )


def tokenize(req: rpb.GenerateRequest, encoder: PromptEncoder, model: ModelInfo) -> tuple[int, ...]:
    """The prompt's token ids (text, chat or given ids), checked against the vocabulary."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        if not req.text:
            raise InvalidArgument("the prompt is empty", reason="EMPTY_PROMPT")
        return encoder.encode(req.text)
    if kind == "chat":
        messages = [chat_message(m) for m in req.chat.messages]
        return encoder.encode_chat(messages, [chat_tool(t) for t in req.chat.tools])
    if kind == "token_ids":
        ids = tuple(req.token_ids.ids)
        if model.vocab_size and any(i >= model.vocab_size for i in ids):
            raise InvalidArgument(
                f"token ids must be below the vocabulary size {model.vocab_size}",
                reason="INVALID_TOKEN_ID",
                field="token_ids",
                param="prompt",
            )
        return ids
    raise InvalidArgument("the prompt is empty", reason="EMPTY_PROMPT")


def prepare(req: rpb.GenerateRequest, encoder: PromptEncoder, model: ModelInfo) -> Prepared:
    """Validates and tokenizes a GenerateRequest, or raises INVALID_ARGUMENT with the reason."""
    if req.model and req.model != model.name:
        raise InvalidArgument(
            f"unknown model {req.model!r}; this router serves {model.name!r}",
            reason="UNKNOWN_MODEL",
            model=req.model,
            param="model",
        )
    if req.mode not in rpb.RoutingMode.values():  # proto3 enums are open: 99 parses
        raise InvalidArgument(
            f"mode {int(req.mode)} is not a RoutingMode", reason="INVALID_MODE", field="mode"
        )
    if len(req.request_id) > 128:
        raise InvalidArgument("request_id is longer than 128 characters", reason="INVALID_REQUEST_ID")
    kind = req.WhichOneof("prompt")
    if kind == "text":
        encoder.check_length([req.text], model.max_context)
    elif kind == "chat":
        texts = [m.content for m in req.chat.messages]
        texts += [c.arguments for m in req.chat.messages for c in m.tool_calls]
        texts += [t.description + t.parameters_json for t in req.chat.tools]
        encoder.check_length(texts, model.max_context, "messages")
    ids = tokenize(req, encoder, model)
    keep = req.sampling.truncate_prompt_tokens
    truncated = 0 < keep < len(ids)
    if truncated:  # vLLM's left truncation: the prompt's last `keep` tokens
        ids = ids[-keep:]
    if not ids:
        raise InvalidArgument("the prompt has no tokens", reason="EMPTY_PROMPT")
    if len(ids) >= model.max_context:
        raise InvalidArgument(
            f"prompt has {len(ids)} tokens; the context limit is {model.max_context}",
            reason="PROMPT_TOO_LONG",
            param="messages" if req.WhichOneof("prompt") == "chat" else "prompt",
            prompt_tokens=len(ids),
            max_context=model.max_context,
        )
    _check_sampling(req.sampling, len(ids), model)
    if req.sampling.resumed_output_tokens >= len(ids):
        raise InvalidArgument(
            f"resumed_output_tokens ({req.sampling.resumed_output_tokens}) must be below the prompt's "
            f"{len(ids)} tokens",
            reason="INVALID_SAMPLING",
            field="resumed_output_tokens",
            param="resumed_output_tokens",
        )
    try:
        check_cache_salt(req.cache_salt)
    except SamplingError as err:
        raise sampling_status(err) from None
    return Prepared(
        request_id=req.request_id or uuid.uuid4().hex,
        token_ids=ids,
        sampling=req.sampling,
        mode=int(req.mode),
        cache_salt=req.cache_salt,
        prompt_text=req.text if kind == "text" and not truncated else None,
        migration=not req.no_migration,
    )


def new_room_id() -> int:
    """The id of one P/D handoff (a directory room, a pair handoff, an SGLang bootstrap room): 63 random
    bits, never 0 (0 means "not set" on the wire)."""
    return secrets.randbits(63) or 1
