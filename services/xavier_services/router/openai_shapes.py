"""OpenAI request parsing and response shapes (completions, chat completions, SSE chunks)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2

from xavier_core.grammar.wire import grammar_to_pb
from xavier_core.runtime import InvalidArgument, XavierError
from xavier_core.runtime.domain_errors import sampling_status
from xavier_core.sampling import MAX_TOP_LOGPROBS, SamplingError, check_cache_salt, check_sampling
from xavier_services.router.openai_body import get_bool, get_int, get_number, get_object, get_str
from xavier_services.router.openai_grammar import grammar_of
from xavier_services.router.openai_sampling import Controls, best_of_count, controls
from xavier_services.router.openai_tools import ToolPlan, tool_calls, tool_plan

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
MAX_PROMPTS = 256
MAX_CHOICES = 256  # choices one request may ask for: prompts x n
"""Prompts one completions request may batch (each becomes a request of its own)."""


def sse(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class TextChunks:
    """Streamed chunks that carry text alone (no logprobs, no finish), made as `render(text, index)`
    makes them but with everything around the text rendered once per choice: a token then costs one
    JSON string encoding. `render` must put the text in as one JSON string (a chat delta with no text
    is `{}`: those go through `render` itself)."""

    _MARK = "\x00text\x00"

    def __init__(self, render: Callable[[str, int], bytes]) -> None:
        self._render = render
        self._around: dict[int, tuple[bytes, ...]] = {}

    def chunk(self, text: str, index: int) -> bytes:
        around = self._around.get(index)
        if around is None:
            whole = self._render(self._MARK, index)
            head, mark, tail = whole.partition(json.dumps(self._MARK).encode())
            around = self._around[index] = (head, tail) if mark else ()
        if not around:  # a renderer that does not hold the text as one string: rendered every time
            return self._render(text, index)
        return around[0] + json.dumps(text).encode() + around[1]


_MAX_TOKEN_ID = (1 << 31) - 1  # PromptTokens.ids are uint32; the router checks the vocabulary later
# Parameters that change what is sampled: a value other than the no-op one is refused (400 naming the
# parameter), never silently ignored. The no-op values are accepted because clients send them by default.
# (Penalties, `min_tokens`, `min_p`, `logit_bias`, `include_stop_str_in_output`, `truncate_prompt_tokens`
# and `best_of` are honoured: `openai_sampling`.)
_NOOP_NUMBERS = {"typical_p": 1.0, "length_penalty": 1.0}
# Extensions (OpenAI's, vLLM's, SGLang's) that no engine here honours yet: any value but an empty one is
# refused. `modalities: ["text"]` and `tool_choice: "none"` ask for nothing, so they pass.
# (`guided_json` and `guided_regex` are honoured as `response_format` is: `openai_grammar`; chat `tools`
# and `tool_choice`: `openai_tools`.)
_NOOP_EMPTY = (
    "functions", "function_call", "suffix", "guided_choice", "guided_grammar", "structured_outputs",
    "bad_words", "allowed_token_ids", "prompt_logprobs", "prediction", "logits_processors",
    "guided_decoding_backend", "guided_whitespace_pattern",
    "return_tokens_as_token_ids", "chat_template", "chat_template_kwargs", "documents",
    "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "no_stop_trim",
    "min_new_tokens", "custom_logit_processor", "return_hidden_states", "lora_path", "audio",
    "web_search_options", "metadata", "reasoning_effort", "verbosity",
)  # fmt: skip
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "modalities": (None, ["text"]),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "early_stopping": (None, False),
    "priority": (None, 0),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "return_token_ids": (None, False),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
}
# Chat-only parameters a completions request may send only as no-ops.
_CHAT_ONLY: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
}


def _unsupported(param: str, what: str) -> InvalidArgument:
    return InvalidArgument(f"{what} is not supported", reason="UNSUPPORTED_PARAMETER", param=param)


def _refuse_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    for key, noops in () if chat else _CHAT_ONLY.items():
        if body.get(key) not in noops:
            raise _unsupported(key, f"{key} on completions")
    for key, noop in _NOOP_NUMBERS.items():
        if get_number(body, key, noop) != noop:
            raise _unsupported(key, f"{key} other than {noop:g}")
    for key in _NOOP_EMPTY:
        if body.get(key) not in (None, "", [], {}):
            raise _unsupported(key, key)
    for key, noops in _NOOP_VALUES.items():
        if body.get(key) not in noops:
            raise _unsupported(key, f"{key} {json.dumps(body.get(key))[:40]}")


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


def _stop_token_ids(value: Any) -> list[int]:
    """The vLLM / SGLang `stop_token_ids` extension: token ids that end the request like EOS."""
    if value is None:
        return []
    if (
        not isinstance(value, list)
        or len(value) > 1024
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID for t in value)
    ):
        raise InvalidArgument(
            "stop_token_ids must be a list of at most 1024 token ids",
            reason="INVALID_SAMPLING",
            param="stop_token_ids",
        )
    return list(value)


def _max_tokens(body: Mapping[str, Any], default: int, echo: bool) -> tuple[int, bool]:
    """`max_tokens` and whether it was 0 with `echo` (the prompt alone is answered: the engines still
    sample one token, which the answer leaves out)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is None:
        return default, False
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{key} must be a positive integer", reason="INVALID_MAX_TOKENS", param=key)
    if value == 0 and echo:
        return 1, True
    return value, False


def _check_limits(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: list[str],
    extra: Controls,
) -> None:
    """The shared sampling limits, checked before the values enter a SamplingParams (a seed out of the
    uint64 range could not); `param` names the field as OpenAI's error shape expects."""
    try:
        check_sampling(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            **extra.limits(),
        )
    except SamplingError as err:
        status = sampling_status(err)
        status.metadata["param"] = err.field
        raise status from None


def _logprobs(body: Mapping[str, Any], chat: bool) -> tuple[bool, int]:
    """Whether the chosen tokens' logprobs are asked for, and how many alternatives beside each: chat
    `logprobs: true` with `top_logprobs` 0..20, completions `logprobs` 0..20 (`true` counts as 0)."""
    if chat:
        wanted = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not wanted:
            raise InvalidArgument(
                "top_logprobs needs logprobs: true", reason="INVALID_ARGUMENT", param="top_logprobs"
            )
        return wanted, top
    value = body.get("logprobs")
    if value is None or value is False:
        return False, 0
    if value is True:  # some clients send the chat form to completions
        return True, 0
    return True, get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS) or 0


# SamplingParams fields an error may name, as each API calls them.
_CHAT_PARAMS = {"prompt_logprobs": "echo"}
_COMPLETION_PARAMS = {"top_logprobs": "logprobs", "prompt_logprobs": "echo"}
_GRAMMAR_FIELDS = ("grammar", "json_schema", "json_object", "regex")


@dataclass
class OpenAiRequest:
    """A parsed OpenAI request: the GenerateRequest plus what the response shape needs."""

    request: rpb.GenerateRequest
    """The (first) prompt's request; `more` holds the others of a prompt batch, sampled alike."""
    stream: bool
    logprobs: bool
    include_usage: bool
    model: str
    chat: bool
    more: tuple[rpb.GenerateRequest, ...] = ()
    n: int = 1
    """Choices per prompt."""
    best_of: int = 1
    """Sequences per prompt (n unless `best_of` was given): `request` and `more` hold every prompt's,
    prompt after prompt, and the n with the highest cumulative logprob are the prompt's choices."""
    max_tokens_to_context: bool = False
    """A chat request without `max_tokens`: as OpenAI, it may run to the context limit (set once the
    prompt's length is known; `max_tokens` is 1 until then)."""
    top_logprobs: int = 0
    """Alternatives per token (completions `logprobs`, chat `top_logprobs`)."""
    echo: bool = False
    """Completions `echo`: the prompt's text (and with logprobs its tokens' logprobs) comes first."""
    echo_only: bool = False
    """`max_tokens: 0` with `echo`: the answer is the prompt alone (the token sampled is left out)."""
    tools: ToolPlan | None = None
    """A chat's tools and tool choice: its answers become `tool_calls` (`openai_tools`)."""
    grammar_param: str = "response_format"
    """The parameter that set `SamplingParams.grammar` (response_format, guided_json, tool_choice, ...)."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def name_params(self, err: XavierError) -> None:
        """Renames an error's `param` from the SamplingParams field to the one this client sent."""
        names = _CHAT_PARAMS if self.chat else _COMPLETION_PARAMS
        param = err.metadata.get("param")
        if param in names:
            err.metadata["param"] = names[param]
        elif param in _GRAMMAR_FIELDS:
            err.metadata["param"] = self.grammar_param


def _content(i: int, content: Any) -> str:
    """A message's text: a string, null (an assistant turn with no text), or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(
            f"messages[{i}].content must be a string or a list of parts",
            reason="INVALID_CHAT",
            param=f"messages[{i}].content",
        )
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if isinstance(kind, str):
                raise _unsupported(f"{where}.type", f"content part type {kind!r} (text only)")
            raise InvalidArgument(f"{where} must be a text part", reason="INVALID_CHAT", param=where)
        if not isinstance(part.get("text"), str):
            raise InvalidArgument(f"{where}.text must be a string", reason="INVALID_CHAT", param=where)
        texts.append(part["text"])
    return "".join(texts)


def _chat(req: rpb.GenerateRequest, body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > _MAX_MESSAGES:
        raise InvalidArgument(
            f"messages must be a non-empty list of at most {_MAX_MESSAGES}",
            reason="EMPTY_PROMPT",
            param="messages",
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument(
                f"messages[{i}] needs a string role", reason="INVALID_CHAT", param=f"messages[{i}].role"
            )
        msg = req.chat.messages.add(role=m["role"], content=_content(i, m.get("content")))
        msg.tool_calls.extend(tool_calls(i, m.get("tool_calls")))
        call_id = m.get("tool_call_id")
        if call_id is not None:
            if not isinstance(call_id, str) or len(call_id) > 256:
                raise InvalidArgument(
                    f"messages[{i}].tool_call_id must be a string of at most 256 characters",
                    reason="INVALID_CHAT",
                    param=f"messages[{i}].tool_call_id",
                )
            msg.tool_call_id = call_id


def _token_ids(prompt: list[Any]) -> list[int]:
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID:
            raise InvalidArgument(
                f"prompt token ids must be integers in [0, {_MAX_TOKEN_ID}]",
                reason="INVALID_TOKEN_ID",
                param="prompt",
            )
    return prompt


def _prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The completion prompts: a string, a list of token ids, or a list of either (a batch, as OpenAI's
    API and lm-eval's `--batch_size` send it), at most `MAX_PROMPTS`."""
    prompt = body.get("prompt")
    if prompt in (None, "", []):
        raise InvalidArgument("the prompt is empty", reason="EMPTY_PROMPT", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not isinstance(prompt, list) or not all(isinstance(p, str | list) for p in prompt):
        raise InvalidArgument(
            "prompt must be a string, a list of token ids, or a list of either",
            reason="INVALID_PROMPT",
            param="prompt",
        )
    if len(prompt) > MAX_PROMPTS:
        raise InvalidArgument(
            f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
            reason="INVALID_PROMPT",
            param="prompt",
        )
    for i, p in enumerate(prompt):
        if p in ("", []):
            raise InvalidArgument(f"prompt[{i}] is empty", reason="EMPTY_PROMPT", param=f"prompt[{i}]")
        if isinstance(p, list) and not all(isinstance(t, int) for t in p):
            raise InvalidArgument(
                f"prompt[{i}] must be a string or a list of token ids",
                reason="INVALID_PROMPT",
                param=f"prompt[{i}]",
            )
    return list(prompt)


def _completion(req: rpb.GenerateRequest, prompt: str | list[int]) -> None:
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(_token_ids(prompt))


def parse(body: Any, chat: bool, served_model: str, default_max_tokens: int) -> OpenAiRequest:
    """Validates an OpenAI request body; every problem is INVALID_ARGUMENT naming the field."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", reason="INVALID_JSON")
    _refuse_unsupported(body, chat)
    model = get_str(body, "model")
    req = rpb.GenerateRequest(model=model, request_id=get_str(body, "user_request_id"))
    # The tenant salt (vLLM's `cache_salt`): prefix-cache and page-store pages are shared only between
    # requests of one salt (checked with the gRPC request's own limits).
    req.cache_salt = get_str(body, "cache_salt")
    try:
        check_cache_salt(req.cache_salt)
    except SamplingError as err:
        raise InvalidArgument(str(err), reason=err.reason, param="cache_salt") from None
    prompts: list[str | list[int]] = []
    if chat:
        _chat(req, body)
    else:
        prompts = _prompts(body)
        _completion(req, prompts[0])
    logprobs, top_logprobs = _logprobs(body, chat)
    echo = get_bool(body, "echo")
    if echo and chat:
        raise _unsupported("echo", "echo on chat completions")
    to_context = chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    max_tokens, echo_only = (1, False) if to_context else _max_tokens(body, default_max_tokens, echo)
    temperature = get_number(body, "temperature", 1.0)
    top_p = get_number(body, "top_p", 1.0)
    # vLLM / SGLang extension: -1 and 0 turn the cut off.
    top_k = max(0, get_int(body, "top_k", -1, 1 << 30, reason="INVALID_SAMPLING") or 0)
    seed = get_int(body, "seed", -(1 << 70), 1 << 70, reason="INVALID_SAMPLING")
    stops = _stops(body.get("stop"))
    extra = controls(body)
    if to_context:  # max_tokens is set once the prompt's length is known; it will be the context left
        max_tokens = max(max_tokens, extra.min_tokens)
    _check_limits(max_tokens, temperature, top_p, top_k, seed, stops, extra)
    s = req.sampling
    s.max_tokens = max_tokens
    s.temperature = temperature
    s.top_p = top_p
    s.top_k = top_k
    s.logprobs = logprobs
    s.top_logprobs = top_logprobs
    s.prompt_logprobs = echo and logprobs
    if seed is not None:
        s.seed = seed
    s.stop.extend(stops)
    s.stop_token_ids.extend(_stop_token_ids(body.get("stop_token_ids")))
    s.ignore_eos = get_bool(body, "ignore_eos")  # the vLLM / SGLang extension
    extra.apply(s)
    plan = tool_plan(body) if chat else None
    grammar = grammar_of(body)
    if plan is not None:
        req.chat.tools.extend(plan.tools)
        if plan.grammar is not None:
            if grammar is not None:
                raise _unsupported(grammar[1], f"{grammar[1]} with tool_choice {plan.choice}")
            grammar = (plan.grammar, "tool_choice")
    if grammar is not None:
        grammar_to_pb(grammar[0], s)
    mode = get_str(body, "xavier_mode")
    if mode:
        if mode not in _MODES:
            raise InvalidArgument(
                f"xavier_mode must be one of {sorted(_MODES)}", reason="INVALID_MODE", param="xavier_mode"
            )
        req.mode = _MODES[mode]
    req.no_migration = not get_bool(body, "xavier_migration", True)
    opts = get_object(body, "stream_options")
    stream = get_bool(body, "stream")
    n = get_int(body, "n", 1, MAX_CHOICES, reason="UNSUPPORTED_N") or 1
    if max(1, len(prompts)) * n > MAX_CHOICES:
        raise InvalidArgument(f"prompts x n must be at most {MAX_CHOICES}", reason="UNSUPPORTED_N", param="n")
    best_of = best_of_count(body, n, stream, MAX_CHOICES)
    if max(1, len(prompts)) * best_of > MAX_CHOICES:
        raise InvalidArgument(
            f"prompts x best_of must be at most {MAX_CHOICES}", reason="INVALID_SAMPLING", param="best_of"
        )
    if best_of > n:  # the router ranks the sequences by their cumulative logprob
        s.logprobs = True
    # Sequences in OpenAI's order: every prompt's best_of (n unless best_of is given) sequences, prompt
    # after prompt; sequence j of a prompt samples with seed + j (when a seed is given), so they differ
    # yet reproduce.
    bases = [req]
    for prompt in prompts[1:]:
        other = rpb.GenerateRequest()
        other.CopyFrom(req)
        other.ClearField("prompt")
        _completion(other, prompt)
        bases.append(other)
    every = []
    for base in bases:
        for j in range(best_of):
            one = rpb.GenerateRequest()
            one.CopyFrom(base)
            if j and one.sampling.HasField("seed"):
                one.sampling.seed = (one.sampling.seed + j) % (1 << 64)
            every.append(one)
    if req.request_id:
        for i, one in enumerate(every[1:], start=1):
            one.request_id = f"{req.request_id}-{i}"
    return OpenAiRequest(
        more=tuple(every[1:]),
        n=n,
        best_of=best_of,
        request=req,
        stream=stream,
        logprobs=logprobs,
        include_usage=get_bool(opts, "include_usage", within="stream_options"),
        model=model or served_model,
        chat=chat,
        max_tokens_to_context=to_context,
        top_logprobs=top_logprobs,
        echo=echo,
        echo_only=echo_only,
        tools=plan,
        grammar_param=grammar[1] if grammar is not None else "response_format",
    )


def usage_json(usage: types_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


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
