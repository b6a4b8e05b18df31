"""The text of a migrated request after its seam, as the engine that started it would have written it.

A request that moves to another pair (`migration`) is re-prefilled with its prompt plus the tokens
already sent; the new engine's text deltas start from that new prompt, so a character whose bytes were
split across the seam, or text held back because it could begin a stop string, would come out wrong.
`SeamText` replays the tokens sent through the engines' own `IncrementalDetokenizer` and `StopMatcher`
(same tokenizer, same stop strings, the original prompt as context) and renders every token after the
seam itself, ending the request where a stop string completes across the seam. It follows
`xavier_core.engine.request.Request.accept`: a token that stops the request itself (EOS, a stop token
id) adds no text and flushes what was held back; a length finish flushes too; before `min_tokens`
tokens (counted from the first attempt's first token) no stop string stops, and
`include_stop_str_in_output` keeps the matched stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from xavier.v1 import types_pb2

from xavier_core.text.tokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer
from xavier_services.router.flows import Step

_STOP = types_pb2.FINISH_REASON_STOP
_LENGTH = types_pb2.FINISH_REASON_LENGTH


class SeamText:
    """Renders the steps of a request's later attempts; built once, at its first migration."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt: Sequence[int],
        sent: Sequence[int],
        stops: Sequence[str],
        *,
        min_tokens: int = 0,
        include: bool = False,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt)
        self._stop = StopMatcher(stops, include=include)
        self._min_tokens = min_tokens
        self._count = 0  # output tokens rendered, the ones sent before the seam included
        for token in sent:  # none of them ended the request, or it would not be moving
            self._stop.feed(self._detok.push(token), armed=self._arm())

    def _arm(self) -> bool:
        """Counts one more output token; whether stop strings stop the request at it (`min_tokens`)."""
        self._count += 1
        return self._count >= self._min_tokens

    def _hits(self, token: int, armed: bool) -> bool:
        """Whether `token` completes a stop string (tried on copies: nothing changes)."""
        return self._stop.copy().feed(self._detok.copy().push(token), armed=armed)[1]

    def _one(self, token: int, finish: int) -> tuple[str, int]:
        """The text of one token and the finish it makes (`finish`: what the engine said of it)."""
        armed = self._arm()
        if finish == _STOP and not self._hits(token, armed):  # the token is the stop itself: no text
            text, _ = self._stop.feed(self._detok.flush())
            return text + self._stop.flush(), _STOP
        text, hit = self._stop.feed(self._detok.push(token), armed=armed)
        if hit:
            return text, _STOP
        if finish == _LENGTH:
            tail, hit = self._stop.feed(self._detok.flush())
            return (text + tail, _STOP) if hit else (text + tail + self._stop.flush(), _LENGTH)
        return text, finish

    def render(self, step: Step) -> Step:
        """`step` with its text re-rendered, cut after the token where a stop string completes."""
        ids = step.token_ids
        if not ids and step.finish:  # an engine's closing step with no token: release what is held
            return Step([], self.length_end().text, finish=step.finish)
        text, finish, kept = "", types_pb2.FINISH_REASON_UNSPECIFIED, 0
        for i, token in enumerate(ids):
            piece, finish = self._one(token, step.finish if i == len(ids) - 1 else 0)
            text, kept = text + piece, i + 1
            if finish:
                break
        return Step(
            ids[:kept],
            text,
            step.logprobs[:kept],
            finish or step.finish,
            top_logprobs=step.top_logprobs[:kept],
            transfer_seconds=step.transfer_seconds,
        )

    def length_end(self) -> Step:
        """The last step of a request whose max_tokens were all sent: the held-back text, LENGTH."""
        tail, hit = self._stop.feed(self._detok.flush())
        return Step([], tail if hit else tail + self._stop.flush(), finish=_STOP if hit else _LENGTH)
