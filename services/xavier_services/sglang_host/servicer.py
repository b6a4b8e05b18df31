"""Xavier's peer RPCs translated to SGLang's native `/generate`.

- Prefill (prefill role): one non-streamed `/generate` with `bootstrap_host`/`bootstrap_port` = this
  service's address (the xavier backend registered the SGLang process under it) and `bootstrap_room` =
  the room id. SGLang answers only once the decode has taken the KV, so the router calls Prefill and
  Decode of an SGLang pair concurrently (`router.pd_concurrent`, HANDOFF_PROTOCOL_CONCURRENT). The answer
  carries no first token (`first_token_source` FIRST_TOKEN_SOURCE_DECODE), and the prompt's logprobs
  when the request asks for them (SGLang's prefill computes the prompt and returns them).
- Decode (decode role): a streamed `/generate` naming the prefill's address; unlike the reference
  engine's Decode, the stream starts with the *first* token (it reaches the decode in the aux buffer,
  with its logprob and alternatives), so a request that hands it one (FIRST_TOKEN_SOURCE_PREFILL) is
  refused. SGLang is not asked for the prompt's logprobs here: its decode never sends them.
- GenerateUnified (unified role): a streamed `/generate`.

Prefill and GenerateUnified pass the request's `cache_salt` in the field the running release honours, or
refuse a salted request with FAILED_PRECONDITION where it cannot be isolated (`salt`).

Cancelling an RPC closes its HTTP connection, which aborts the request inside SGLang.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
from xavier.v1 import decode_service_pb2 as dpb
from xavier.v1 import decode_service_pb2_grpc, prefill_service_pb2_grpc, types_pb2
from xavier.v1 import prefill_service_pb2 as ppb

from xavier_core.runtime.config import parse_host_port
from xavier_core.runtime.durations import to_duration
from xavier_core.runtime.errors import Aborted, FailedPrecondition, Internal, InvalidArgument
from xavier_core.runtime.identity import ROLE_NAMES, require
from xavier_services.peer.convert import check_room_id, sampling_from_pb
from xavier_services.peer.sessions import decode_session, prefill_session
from xavier_services.sglang_host.host import SglangHost
from xavier_services.sglang_host.protocol import Delta, abort_message, generate_body, prompt_logprobs_of
from xavier_services.sglang_host.stats import engine_stats

Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def _check(token_ids: list[int], sampling: types_pb2.SamplingParams) -> None:
    if not token_ids:
        raise InvalidArgument("token_ids is empty", field="token_ids")
    sampling_from_pb(sampling)  # the shared sampling validator; SGLang checks context and vocabulary


def _usage(meta: dict[str, object], prompt_tokens: int, completion: int) -> types_pb2.Usage:
    cached = int(str(meta.get("cached_tokens") or 0))
    return types_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        cached_tokens=cached,
        cached_tokens_local=cached,
    )


def _transfer_failed(delta: Delta, role: str) -> Aborted | None:
    """An `abort` ending before any token: SGLang gave the request up (in P/D, the KV transfer)."""
    message = abort_message(delta.meta)
    if message and not delta.token_ids:
        return Aborted(f"SGLang aborted the {role}: {message}", reason="TRANSFER_FAILED")
    return None


def _prompt_logprobs(meta: dict[str, object], s: types_pb2.SamplingParams) -> types_pb2.PromptLogprobs | None:
    """The prompt's logprobs in a prefill's answer, when the request asked for them. SGLang's prefill
    returns them like a unified server (its output streamer sends input logprobs in every mode but the
    decode's); an answer without them is an engine error, never a request answered without them."""
    if not s.prompt_logprobs:
        return None
    prompt = prompt_logprobs_of(meta)
    if prompt is None:
        raise Internal("SGLang's prefill answered without the prompt's logprobs", reason="ENGINE_ERROR")
    return prompt


class _Base:
    def __init__(self, host: SglangHost) -> None:
        self.host = host

    def _check_mode(self, role: types_pb2.Role.ValueType, rpc: str) -> None:
        host = self.host
        if host.role != role:
            name = ROLE_NAMES[host.role]
            raise FailedPrecondition(f"{rpc} is not served by a {name} peer", reason="WRONG_ROLE")
        if host.native:
            raise FailedPrecondition(
                "this SGLang uses its own NIXL backend: use the router's native mode", reason="WRONG_ROLE"
            )


class SglangPrefillServicer(_Base, prefill_service_pb2_grpc.PrefillServiceServicer):  # type: ignore[misc]
    async def Prefill(self, request: ppb.PrefillRequest, context: Ctx) -> ppb.PrefillResponse:
        require(context, "Prefill", roles=("router",))
        host = self.host
        self._check_mode(types_pb2.ROLE_PREFILL, "Prefill")
        check_room_id(request.room_id)
        token_ids = list(request.token_ids)
        _check(token_ids, request.sampling)
        bootstrap_host, bootstrap_port = parse_host_port(host.address)
        body = generate_body(
            f"xp-{request.room_id}",
            token_ids,
            request.sampling,
            stream=False,
            bootstrap=(bootstrap_host, bootstrap_port, request.room_id),
        )
        host.salts.apply(body, request.cache_salt)
        started = time.perf_counter()
        with host.busy():
            answer = await host.sglang.generate(body)
        meta = answer.get("meta_info") or {}
        ids = [int(t) for t in answer.get("output_ids") or []]
        failed = _transfer_failed(Delta(ids, "", [], 0, meta), "prefill")
        if failed is not None:
            raise failed
        took = to_duration(time.perf_counter() - started)
        # The pair's decode streams the first token (it reaches it in SGLang's aux buffer): this answer
        # carries none, whether or not SGLang returned its ids.
        return ppb.PrefillResponse(
            first_token_source=types_pb2.FIRST_TOKEN_SOURCE_DECODE,
            usage=_usage(meta, len(token_ids), len(ids)),
            timings=types_pb2.Timings(prefill=took),
            prompt_logprobs=_prompt_logprobs(meta, request.sampling),
        )

    async def PrefillSession(self, requests: AsyncIterator[ppb.PrefillSessionRequest], context: Ctx) -> None:
        await prefill_session(requests, context, self.Prefill)

    async def GetPrefillStats(
        self, request: ppb.GetPrefillStatsRequest, context: Ctx
    ) -> ppb.GetPrefillStatsResponse:
        host = self.host
        return ppb.GetPrefillStatsResponse(
            engine=await engine_stats(host.sglang_or_none, host.inflight, host.config.engine.page_size),
            rooms_active=host.inflight,
            peer=f"{host.peer_id}@{host.epoch}",
        )


class SglangDecodeServicer(_Base, decode_service_pb2_grpc.DecodeServiceServicer):  # type: ignore[misc]
    async def Decode(self, request: dpb.DecodeRequest, context: Ctx) -> AsyncIterator[dpb.DecodeResponse]:
        require(context, "Decode", roles=("router",))
        host = self.host
        self._check_mode(types_pb2.ROLE_DECODE, "Decode")
        check_room_id(request.room_id)
        if not request.prefill_peer_id:
            raise InvalidArgument("prefill_peer_id is required", field="prefill_peer_id")
        if request.first_token_source == types_pb2.FIRST_TOKEN_SOURCE_PREFILL:
            raise InvalidArgument(
                "this decode streams its own first token (first_token_source DECODE)",
                field="first_token_source",
            )
        token_ids = list(request.token_ids)
        _check(token_ids, request.sampling)
        prefill = await host.prefill_address(request.prefill_peer_id, request.prefill_epoch)
        bootstrap_host, bootstrap_port = parse_host_port(prefill)
        body = generate_body(
            f"xd-{request.room_id}",
            token_ids,
            request.sampling,
            bootstrap=(bootstrap_host, bootstrap_port, request.room_id),
            with_prompt_logprobs=False,  # the pair's prefill answers them
        )
        started = time.perf_counter()
        n = 0
        with host.busy():
            async for delta in host.sglang.stream(body):
                failed = _transfer_failed(delta, "decode") if n == 0 else None
                if failed is not None:
                    raise failed
                n += len(delta.token_ids)
                msg = dpb.DecodeResponse(
                    delta=self._delta(delta, request.sampling), finish_reason=delta.finish
                )
                if delta.finish:
                    msg.usage.CopyFrom(_usage(delta.meta, len(token_ids), n))
                    msg.timings.CopyFrom(types_pb2.Timings(total=to_duration(time.perf_counter() - started)))
                yield msg

    async def DecodeSession(self, requests: AsyncIterator[dpb.DecodeSessionRequest], context: Ctx) -> None:
        await decode_session(requests, context, self.Decode)

    async def GenerateUnified(
        self, request: dpb.GenerateUnifiedRequest, context: Ctx
    ) -> AsyncIterator[dpb.GenerateUnifiedResponse]:
        require(context, "GenerateUnified", roles=("router",))
        host = self.host
        self._check_mode(types_pb2.ROLE_UNIFIED, "GenerateUnified")
        token_ids = list(request.token_ids)
        _check(token_ids, request.sampling)
        body = generate_body(request.request_id, token_ids, request.sampling)
        host.salts.apply(body, request.cache_salt)
        started = time.perf_counter()
        first_at: float | None = None
        n = 0
        with host.busy():
            async for delta in host.sglang.stream(body):
                if first_at is None and delta.token_ids:
                    first_at = time.perf_counter() - started
                n += len(delta.token_ids)
                msg = dpb.GenerateUnifiedResponse(
                    delta=self._delta(delta, request.sampling), finish_reason=delta.finish
                )
                if delta.prompt_logprobs is not None and request.sampling.prompt_logprobs:
                    msg.prompt_logprobs.CopyFrom(delta.prompt_logprobs)
                if delta.finish:
                    msg.usage.CopyFrom(_usage(delta.meta, len(token_ids), n))
                    msg.timings.CopyFrom(
                        types_pb2.Timings(
                            time_to_first_token=to_duration(first_at or 0.0),
                            total=to_duration(time.perf_counter() - started),
                        )
                    )
                yield msg

    @staticmethod
    def _delta(delta: Delta, sampling: types_pb2.SamplingParams) -> dpb.TokenDelta:
        return dpb.TokenDelta(
            token_ids=delta.token_ids,
            logprobs=delta.logprobs if sampling.logprobs else [],
            text=delta.text,
            top_logprobs=delta.top_logprobs if sampling.top_logprobs else [],
        )

    async def GetDecodeStats(
        self, request: dpb.GetDecodeStatsRequest, context: Ctx
    ) -> dpb.GetDecodeStatsResponse:
        host = self.host
        return dpb.GetDecodeStatsResponse(
            engine=await engine_stats(host.sglang_or_none, host.inflight, host.config.engine.page_size),
            rooms_active=host.inflight if host.role == types_pb2.ROLE_DECODE else 0,
            peer=f"{host.peer_id}@{host.epoch}",
            role=host.role,
        )
