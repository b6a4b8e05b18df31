"""Request building and result types shared by the sync and asyncio clients."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2

from xavier_client._errors import InvalidArgumentError

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
"""Plain text, token ids, or chat messages ({"role": ..., "content": ...})."""

Mode = Literal["pd", "colocated", "native"]

ClusterStatus = rpb.GetClusterStatusResponse
"""What `cluster_status()` returns: the router's live requests, its default mode, one `ClusterPeer` per
registered peer and the `ClusterRooms` counters (unset when the directory could not be read)."""
ClusterPeer = rpb.ClusterPeer
"""One peer's public status: id, role, epoch, address, model, contract fingerprint, load, engine stats,
rooms; never its transfer endpoint, NIXL metadata or memory addresses."""
ClusterRooms = rpb.ClusterRooms
"""Room counters: live rooms now, and rooms opened, completed, aborted, expired since start."""

_MODES: dict[str, int] = {
    "pd": rpb.ROUTING_MODE_PD,
    "colocated": rpb.ROUTING_MODE_COLOCATED,
    "native": rpb.ROUTING_MODE_NATIVE,
}
_FINISH: dict[int, str] = {
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_ABORT: "abort",
}


def mode_name(value: int) -> str | None:
    """ "pd", "colocated", "native" or None for a RoutingMode value."""
    for name, number in _MODES.items():
        if number == value:
            return name
    return None


@dataclass(frozen=True)
class Sampling:
    """Sampling and stopping; `max_tokens` counts every generated token."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    """Most likely alternatives returned beside each token (0..20)."""
    prompt_logprobs: bool = False
    """Return the prompt tokens' logprobs too (engines that declare it)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int = 0
    json_schema: str | None = None
    """A JSON Schema (JSON text) the output must validate; at most one of json_schema, json_object, regex."""
    json_object: bool = False
    regex: str | None = None
    resumed_output_tokens: int = 0
    """How many of the prompt's last tokens are output an earlier attempt of this request produced (a
    request resumed by its caller): penalties and the grammar count them as output; 0 is a plain request."""

    def to_proto(self) -> types_pb2.SamplingParams:
        """The wire form; `InvalidArgumentError` naming the field for a value it cannot carry (the
        server would refuse it anyway; protobuf alone says only "Value out of range")."""
        limits = {
            "max_tokens": 2**32,
            "top_k": 2**32,
            "seed": 2**64,
            "top_logprobs": 2**32,
            "min_tokens": 2**32,
            "truncate_prompt_tokens": 2**32,
            "resumed_output_tokens": 2**32,
        }
        for name, limit in limits.items():
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit
            ):
                raise _invalid(f"{name} must be an integer in 0..{limit - 1}, got {value!r}", name)
        if any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32 for t in self.stop_token_ids
        ):
            raise _invalid("stop_token_ids must be integers in 0..4294967295", "stop_token_ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32 for t in self.logit_bias):
            raise _invalid("logit_bias keys must be token ids in 0..4294967295", "logit_bias")
        grammars = [g for g in ("json_schema", "regex") if getattr(self, g) is not None]
        if self.json_object:
            grammars.append("json_object")
        if len(grammars) > 1:
            raise _invalid(f"at most one grammar, got {', '.join(grammars)}", grammars[1])
        msg = types_pb2.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias),
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            resumed_output_tokens=self.resumed_output_tokens,
        )
        if self.json_schema is not None:
            msg.json_schema = self.json_schema
        elif self.regex is not None:
            msg.regex = self.regex
        elif self.json_object:
            msg.json_object = True
        return msg


def _invalid(message: str, field_name: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, reason="INVALID_ARGUMENT", metadata={"field": field_name})


def build_request(
    prompt: Prompt,
    sampling: Sampling,
    *,
    model: str = "",
    mode: Mode | None = None,
    request_id: str | None = None,
    cache_salt: str = "",
) -> rpb.GenerateRequest:
    """The GenerateRequest for a prompt; a request id is made when none is given (for `abort`)."""
    req = rpb.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        model=model,
        sampling=sampling.to_proto(),
        cache_salt=cache_salt,
    )
    if mode is not None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
        req.mode = _MODES[mode]
    if isinstance(prompt, str):
        req.text = prompt
    elif all(isinstance(item, int) for item in prompt):
        req.token_ids.ids.extend(int(i) for i in prompt if isinstance(i, int))
    else:
        for msg in prompt:
            if not isinstance(msg, Mapping):
                raise TypeError("a chat prompt is a sequence of {'role', 'content'} mappings")
            req.chat.messages.add(role=msg["role"], content=msg["content"])
    return req


@dataclass(frozen=True)
class Chunk:
    """One streamed step: new token ids, their text, and on the last chunk the finish reason."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()
    finish_reason: str | None = None
    raw: rpb.GenerateResponse | None = None

    @classmethod
    def from_proto(cls, msg: rpb.GenerateResponse) -> Chunk:
        return cls(
            request_id=msg.request_id,
            token_ids=tuple(msg.token_ids),
            text=msg.text,
            logprobs=tuple(msg.logprobs),
            finish_reason=_FINISH.get(msg.finish_reason),
            raw=msg,
        )


@dataclass
class Completion:
    """A whole answer: text, token ids, finish reason, usage and timings (seconds)."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    mode: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_local: int = 0  # of cached_tokens: from the replica's own prefix cache
    cached_tokens_store: int = 0  # of cached_tokens: fetched from the page store
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    """Per generated token, its most likely alternatives (token id to logprob), when asked for."""

    def add(self, chunk: Chunk) -> None:
        """Folds one streamed chunk into the answer."""
        self.request_id = chunk.request_id or self.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        msg = chunk.raw
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if msg is None:
            return
        self.top_logprobs.extend(dict(zip(t.token_ids, t.logprobs, strict=True)) for t in msg.top_logprobs)
        if msg.mode:
            self.mode = mode_name(msg.mode)
        if msg.HasField("usage"):
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            self.cached_tokens = msg.usage.cached_tokens
            self.cached_tokens_local = msg.usage.cached_tokens_local
            self.cached_tokens_store = msg.usage.cached_tokens_store
        if msg.HasField("timings"):
            self.time_to_first_token = msg.timings.time_to_first_token.ToTimedelta().total_seconds()
            self.total_time = msg.timings.total.ToTimedelta().total_seconds()
