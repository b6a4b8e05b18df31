"""SGLang's native HTTP API as Xavier uses it: the `/generate` body and its server-sent events.

A streamed `/generate` answers `data: {...}` events whose `text`, `output_ids` and
`meta_info.output_token_logprobs` are cumulative, with `meta_info.finish_reason` set on the last event
(`{"type": "stop" | "length" | "abort", ...}`), then `data: [DONE]`. An event with `error` reports a
failure after the stream started. `Deltas` turns the cumulative fields into the deltas Xavier streams.
Shared by the services that host SGLang and by the router's native mode.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from xavier.v1 import types_pb2

from xavier_core.grammar.spec import JSON_OBJECT_SCHEMA, GrammarKind
from xavier_core.grammar.wire import grammar_from_pb
from xavier_core.runtime.errors import Internal, InvalidArgument

__all__ = ["Delta", "Deltas", "generate_body", "prompt_logprobs_of", "sampling_params", "sse_events"]

MAX_EVENT_BYTES = 256 << 20
"""The longest server-sent event read (a cumulative event of ~6M tokens with logprobs)."""

_FINISH = {
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "abort": types_pb2.FINISH_REASON_ABORT,
}


def sampling_params(s: types_pb2.SamplingParams) -> dict[str, Any]:
    """SGLang's `sampling_params` for Xavier's (0 top_p: off; 0 top_k: off). A control left at its off
    value adds no key, so a request that uses none maps to SGLang's defaults. What SGLang would do
    otherwise than Xavier defines it is refused (INVALID_ARGUMENT, UNSUPPORTED_PARAMETER)."""
    _refuse_unmatched(s)
    params: dict[str, Any] = {
        "max_new_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p if s.top_p > 0 else 1.0,
        "ignore_eos": s.ignore_eos,
    }
    if s.top_k:
        params["top_k"] = s.top_k
    if s.stop:
        params["stop"] = list(s.stop)
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.HasField("seed"):
        params["sampling_seed"] = s.seed
    if s.min_p:
        params["min_p"] = s.min_p
    if s.min_tokens:
        params["min_new_tokens"] = s.min_tokens
    if s.presence_penalty:
        params["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        params["frequency_penalty"] = s.frequency_penalty
    if s.logit_bias:
        params["logit_bias"] = {str(token): bias for token, bias in sorted(s.logit_bias.items())}
    if s.include_stop_str_in_output:
        params["no_stop_trim"] = True
    grammar = grammar_from_pb(s)
    if grammar is not None:
        # SGLang's xgrammar backend reads an object schema as Xavier's (strict, compact with
        # `--constrained-json-disable-any-whitespace`, which the service launches SGLang with).
        if grammar.kind is GrammarKind.REGEX:
            params["regex"] = grammar.text
        else:
            params["json_schema"] = (
                JSON_OBJECT_SCHEMA if grammar.kind is GrammarKind.JSON_OBJECT else grammar.text
            )
    return params


def _refuse_unmatched(s: types_pb2.SamplingParams) -> None:
    """SGLang's repetition penalty counts the output only (Xavier's the prompt too); its stop strings
    stop before min_new_tokens (Xavier's do not); its no_stop_trim keeps a stop token's text too."""
    refused = []
    if s.repetition_penalty not in (0.0, 1.0):
        refused.append(("repetition_penalty", "repetition_penalty"))
    if s.min_tokens and s.stop:
        refused.append(("min_tokens", "min_tokens with stop strings"))
    if s.include_stop_str_in_output and s.stop_token_ids:
        refused.append(("include_stop_str_in_output", "include_stop_str_in_output with stop_token_ids"))
    if refused:
        param, what = refused[0]
        raise InvalidArgument(
            f"{what} is not supported by SGLang engines",
            reason="UNSUPPORTED_PARAMETER",
            field=f"sampling.{param}",
            param=param,
        )


def generate_body(
    rid: str,
    token_ids: list[int],
    s: types_pb2.SamplingParams,
    *,
    stream: bool = True,
    bootstrap: tuple[str, int, int] | None = None,
    with_prompt_logprobs: bool = True,
) -> dict[str, Any]:
    """A `/generate` body; `bootstrap` = (host, port, room) pairs a P/D prefill with its decode. Both
    servers of a pair get the whole request (see `xavier_sglang.features`), except that a pair's decode
    is asked for no prompt logprobs (`with_prompt_logprobs` False): SGLang's decode computes no prompt
    and its output streamer never sends them (the pair's prefill answers them)."""
    prompt = s.prompt_logprobs and with_prompt_logprobs
    body: dict[str, Any] = {
        "input_ids": list(token_ids),
        "sampling_params": sampling_params(s),
        "stream": stream,
        # SGLang ignores logprob_start_len without return_logprob (the output's are then dropped here).
        "return_logprob": s.logprobs or prompt,
    }
    if s.top_logprobs:
        body["top_logprobs_num"] = s.top_logprobs
    if prompt:
        # From the prompt's first token: SGLang then computes the whole prompt (no prefix-cache hit).
        body["logprob_start_len"] = 0
    if rid:
        body["rid"] = rid
    if bootstrap is not None:
        body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"] = bootstrap
    return body


def finish_of(meta: dict[str, Any]) -> types_pb2.FinishReason.ValueType:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    return _FINISH.get(str(reason), types_pb2.FINISH_REASON_STOP) if reason else 0


def abort_message(meta: dict[str, Any]) -> str:
    """The message of an `abort` finish ("" for any other ending)."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return str(reason.get("message") or "aborted")
    return ""


def _logprobs_of(meta: dict[str, Any]) -> list[float]:
    # output_token_logprobs = [[logprob, token_id, text], ...] (cumulative).
    items = meta.get("output_token_logprobs") or []
    return [float(x[0]) for x in items if isinstance(x, list | tuple) and x]


def _top(entries: Any) -> types_pb2.TopLogprobs:
    """One position's alternatives, `[[logprob, token_id, text], ...]` most likely first (None: none)."""
    top = types_pb2.TopLogprobs()
    for entry in entries or []:
        top.logprobs.append(float(entry[0]))
        top.token_ids.append(int(entry[1]))
    return top


def _tops_of(meta: dict[str, Any]) -> list[types_pb2.TopLogprobs]:
    # output_top_logprobs = one list of alternatives per output token (cumulative; present when
    # top_logprobs_num > 0).
    return [_top(entries) for entries in meta.get("output_top_logprobs") or []]


def prompt_logprobs_of(meta: dict[str, Any]) -> types_pb2.PromptLogprobs | None:
    """The prompt's logprobs from `input_token_logprobs` (and `input_top_logprobs`), None while the
    event has none. With logprob_start_len 0 SGLang's first entry (the first prompt token, under no
    prompt) has logprob None; Xavier's list starts at the second token."""
    items = meta.get("input_token_logprobs")
    if not items:
        return None
    out = types_pb2.PromptLogprobs(logprobs=[float(x[0]) for x in items[1:]])
    tops = meta.get("input_top_logprobs")
    if tops:
        out.top_logprobs.extend(_top(entries) for entries in tops[1:])
    return out


@dataclass
class Delta:
    """What one event adds: new token ids, text and logprobs; `finish` on the last. `top_logprobs`
    holds one entry per new token when the request asked for alternatives; `prompt_logprobs` comes
    once, with the first event that carries them."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish: types_pb2.FinishReason.ValueType
    meta: dict[str, Any] = field(default_factory=dict)
    top_logprobs: list[types_pb2.TopLogprobs] = field(default_factory=list)
    prompt_logprobs: types_pb2.PromptLogprobs | None = None


@dataclass
class Deltas:
    """Cumulative event fields → deltas (what was already sent is remembered)."""

    ids_sent: int = 0
    text_sent: int = 0
    lps_sent: int = 0
    tops_sent: int = 0
    prompt_sent: bool = False

    def next(self, event: dict[str, Any]) -> Delta:
        meta = event.get("meta_info") or {}
        ids = [int(t) for t in event.get("output_ids") or []]
        text = str(event.get("text") or "")
        lps = _logprobs_of(meta)
        tops = _tops_of(meta)
        delta = Delta(
            ids[self.ids_sent :],
            text[self.text_sent :],
            lps[self.lps_sent :],
            finish_of(meta),
            meta,
            tops[self.tops_sent :],
        )
        if not self.prompt_sent:
            delta.prompt_logprobs = prompt_logprobs_of(meta)
            self.prompt_sent = delta.prompt_logprobs is not None
        self.ids_sent, self.text_sent, self.lps_sent = len(ids), len(text), len(lps)
        self.tops_sent = len(tops)
        return delta


async def _lines(resp: aiohttp.ClientResponse, who: str, reason: str) -> AsyncIterator[bytes]:
    """The answer's lines, however long. Events are cumulative, so a long output's last events are long
    too (with logprobs ~40 bytes a token): aiohttp's own line reader refuses lines over twice its read
    buffer (512 KiB), past which a long request would fail; this caps a line at `MAX_EVENT_BYTES`."""
    buf = bytearray()
    scanned = 0  # no newline in buf[:scanned]
    async for chunk in resp.content.iter_any():
        buf += chunk
        while (end := buf.find(b"\n", scanned)) >= 0:
            yield bytes(buf[:end])
            del buf[: end + 1]
            scanned = 0
        scanned = len(buf)
        if scanned > MAX_EVENT_BYTES:
            raise Internal(f"{who} sent an event over {MAX_EVENT_BYTES} bytes", reason=reason)
    if buf:
        yield bytes(buf)


async def sse_events(resp: aiohttp.ClientResponse, who: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a streamed answer, up to `[DONE]`; an `error` event raises `Internal`
    (NATIVE_ERROR when `who` is a native server, ENGINE_ERROR otherwise)."""
    reason = "NATIVE_ERROR" if who.startswith("native") else "ENGINE_ERROR"
    async for raw in _lines(resp, who, reason):
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise Internal(f"{who} sent a malformed event: {data[:200]}", reason=reason) from None
        if not isinstance(event, dict):
            raise Internal(f"{who} sent a malformed event: {data[:200]}", reason=reason)
        if "error" in event:
            raise Internal(f"{who} failed: {event['error']}", reason=reason)
        yield event
