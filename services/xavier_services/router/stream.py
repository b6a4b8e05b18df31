"""What a request's steps add up to, and the responses the reader builds from them.

The reader (`Router._read` in `core`) adds each step of the request's flow to a `Tally`;
`step_response` and `last_response` turn steps and the tally into `GenerateResponse`s.
"""

from __future__ import annotations

from dataclasses import dataclass

from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2

from xavier_core.runtime.durations import to_duration
from xavier_services.router.flows import Step


@dataclass
class Tally:
    """What one request's steps add up to: tokens, time to the first one, the cache and phase figures
    the last step that had each carried, and the finishing step."""

    completion: int = 0
    ttft: float | None = None
    cached: int | None = None
    store: int | None = None
    prefill_s: float | None = None
    transfer_s: float | None = None
    finish: int = types_pb2.FINISH_REASON_UNSPECIFIED
    last: Step | None = None

    def add(self, step: Step) -> None:
        self.completion += len(step.token_ids)
        self.cached = step.cached_tokens if step.cached_tokens is not None else self.cached
        self.store = step.cached_tokens_store if step.cached_tokens_store is not None else self.store
        self.prefill_s = step.prefill_seconds if step.prefill_seconds is not None else self.prefill_s
        self.transfer_s = step.transfer_seconds if step.transfer_seconds is not None else self.transfer_s
        self.finish = step.finish
        if step.finish:
            self.last = step


def step_response(request_id: str, mode: int, step: Step) -> rpb.GenerateResponse:
    """A response in the stream: the tokens and text of one step."""
    return rpb.GenerateResponse(
        request_id=request_id,
        token_ids=step.token_ids,
        text=step.text,
        logprobs=step.logprobs,
        mode=mode,
        top_logprobs=step.top_logprobs,
        prompt_logprobs=step.prompt_logprobs,
    )


def last_response(
    request_id: str, mode: int, prompt_tokens: int, tally: Tally, total: float
) -> rpb.GenerateResponse:
    """The stream's last response: the finishing step's tokens (none when the flow ended without one),
    the finish reason, usage and timings (`total` seconds since the request arrived)."""
    last = tally.last
    cached, store = tally.cached or 0, tally.store or 0
    return rpb.GenerateResponse(
        request_id=request_id,
        token_ids=last.token_ids if last else [],
        text=last.text if last else "",
        logprobs=last.logprobs if last else [],
        top_logprobs=last.top_logprobs if last else [],
        prompt_logprobs=last.prompt_logprobs if last else None,
        finish_reason=tally.finish,
        usage=types_pb2.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=tally.completion,
            cached_tokens=cached,
            cached_tokens_local=cached - store,
            cached_tokens_store=store,
        ),
        timings=types_pb2.Timings(
            time_to_first_token=to_duration(tally.ttft if tally.ttft is not None else total),
            prefill=to_duration(tally.prefill_s or 0.0),
            transfer=to_duration(tally.transfer_s or 0.0),
            total=to_duration(total),
        ),
        mode=mode,
    )
