"""OpenAI request parsing and response shapes (completions, chat completions, SSE chunks)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2

from xavier_core.runtime import InvalidArgument
from xavier_core.runtime.domain_errors import sampling_status
from xavier_core.sampling import SamplingError, check_sampling

FINISH_NAMES = {
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_ABORT: "abort",
}
_MODES = {
    "pd": rpb.ROUTING_MODE_PD,
    "colocated": rpb.ROUTING_MODE_COLOCATED,
    "native": rpb.ROUTING_MODE_NATIVE,
}
_MAX_MESSAGES = 1024


def sse(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{key} must be a number", reason="INVALID_SAMPLING", param=key)
    return float(value)


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise InvalidArgument(
        "stop must be a string or a list of strings", reason="INVALID_SAMPLING", param="stop"
    )


def _max_tokens(body: Mapping[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(
            "max_tokens must be a positive integer", reason="INVALID_MAX_TOKENS", param="max_tokens"
        )
    return value


def _check_limits(
    max_tokens: int, temperature: float, top_p: float, seed: int | None, stop: list[str]
) -> None:
    """The shared sampling limits, checked before the values enter a SamplingParams (a seed out of the
    uint64 range could not); `param` names the field as OpenAI's error shape expects."""
    try:
        check_sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop)
    except SamplingError as err:
        status = sampling_status(err)
        status.metadata["param"] = err.field
        raise status from None


@dataclass
class OpenAiRequest:
    """A parsed OpenAI request: the GenerateRequest plus what the response shape needs."""

    request: rpb.GenerateRequest
    stream: bool
    logprobs: bool
    include_usage: bool
    model: str
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def parse(body: Any, chat: bool, served_model: str, default_max_tokens: int) -> OpenAiRequest:
    """Validates an OpenAI request body; every problem is INVALID_ARGUMENT naming the field."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", reason="INVALID_JSON")
    n = body.get("n", 1)
    if n != 1:
        raise InvalidArgument("only n=1 is supported", reason="UNSUPPORTED_N", param="n")
    if body.get("echo") or body.get("best_of", 1) not in (1, None) or body.get("suffix"):
        raise InvalidArgument("echo, best_of and suffix are not supported", reason="UNSUPPORTED_PARAMETER")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise InvalidArgument("model must be a string", reason="UNKNOWN_MODEL", param="model")
    req = rpb.GenerateRequest(model=model, request_id=str(body.get("user_request_id") or ""))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or len(messages) > _MAX_MESSAGES:
            raise InvalidArgument(
                "messages must be a non-empty list", reason="EMPTY_PROMPT", param="messages"
            )
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # text parts only
                parts = [
                    p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                ]
                content = "".join(parts)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise InvalidArgument(
                    f"messages[{i}] needs a string role and content", reason="INVALID_CHAT", param="messages"
                )
            req.chat.messages.add(role=m["role"], content=content)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("the prompt is empty", reason="EMPTY_PROMPT", param="prompt")
            req.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            req.token_ids.ids.extend(prompt)
        elif prompt in (None, "", []):
            raise InvalidArgument("the prompt is empty", reason="EMPTY_PROMPT", param="prompt")
        else:
            raise InvalidArgument(
                "prompt must be a string or a list of token ids (one prompt per request)",
                reason="INVALID_PROMPT",
                param="prompt",
            )
    lp = body.get("logprobs")
    logprobs = bool(lp) if chat else lp is not None and lp is not False
    max_tokens = _max_tokens(body, default_max_tokens)
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgument("seed must be a non-negative integer", reason="INVALID_SAMPLING", param="seed")
    stops = _stops(body.get("stop"))
    _check_limits(max_tokens, temperature, top_p, seed, stops)
    s = req.sampling
    s.max_tokens = max_tokens
    s.temperature = temperature
    s.top_p = top_p
    s.logprobs = logprobs
    if seed is not None:
        s.seed = seed
    s.stop.extend(stops)
    s.ignore_eos = bool(body.get("ignore_eos", False))  # the vLLM / SGLang extension
    mode = body.get("xavier_mode")
    if mode is not None:
        if mode not in _MODES:
            raise InvalidArgument(f"xavier_mode must be one of {sorted(_MODES)}", reason="INVALID_MODE")
        req.mode = _MODES[mode]
    opts = body.get("stream_options") or {}
    return OpenAiRequest(
        request=req,
        stream=bool(body.get("stream")),
        logprobs=logprobs,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        model=model or served_model,
        chat=chat,
    )


def usage_json(usage: types_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def logprobs_json(chat: bool, tokens: list[str], values: list[float]) -> dict[str, Any]:
    """OpenAI logprobs of the chosen tokens (no alternatives: top_logprobs stay empty)."""
    if chat:
        content = [
            {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
            for t, v in zip(tokens, values, strict=False)
        ]
        return {"content": content}
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


def choice(
    oa: OpenAiRequest,
    text: str,
    finish: str | None,
    logprobs: dict[str, Any] | None,
    *,
    delta: bool,
    first: bool = False,
) -> dict[str, Any]:
    """One `choices[0]` entry of a response or a chunk."""
    out: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
    if not oa.chat:
        out["text"] = text
    elif delta:
        out["delta"] = (
            ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
        )
    else:
        out["message"] = {"role": "assistant", "content": text}
    return out


def envelope(oa: OpenAiRequest, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
    """The response object around the choices."""
    if oa.chat:
        obj, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
    else:
        obj, prefix = "text_completion", "cmpl-"
    return {"id": prefix + oa.id, "object": obj, "created": oa.created, "model": oa.model, "choices": choices}
