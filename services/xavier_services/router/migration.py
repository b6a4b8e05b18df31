"""Request migration: a decode that fails or stalls mid-stream hands its request to another pair.

`migrating` wraps a request's flow (P/D or colocated). The flows fail over on their own until a decode
token reached the client; after that a failed or stalled peer raises `flows.StreamBroken`, and here the
request is resumed on another healthy compatible pair (or unified replica, in colocated mode):

- the new prompt is the prompt plus every token the client got, `max_tokens` and `min_tokens` (floor
  0) less those tokens, the same sampling otherwise, and the seed advanced by them
  (`xavier_core.sampling.advance_seed`: the engines draw token i of a seeded request from
  `step_seed(seed, i)`, so the continuation draws what the uninterrupted run would have); prompt
  logprobs are not asked again;
- `SamplingParams.resumed_output_tokens` tells the new engines that the prompt's tail is output:
  presence and frequency penalties keep counting it and a grammar's matcher is advanced over it before
  the first new token (the prefill's first token in P/D, the unified replica's in colocated mode), so
  a penalized or structured request continues as the uninterrupted one would. Those requests need
  `ENGINE_FEATURE_RESUMED_OUTPUT` on both engines of the new pair (`request.needed_features`); a pair
  without it is refused by the flow before any call, and the move ends MIGRATION_FAILED with `why`
  UNSUPPORTED_PARAMETER (a move was due and could not be made exact, which PEER_FAILED would not say).
  Other requests (repetition penalty, logit bias, `min_tokens` alone) need nothing of the engine;
- the client's stream goes on: the later attempts' steps are re-rendered by `seam_text.SeamText`, so
  text continues exactly across the seam (split UTF-8, text held for a stop string, stop strings not
  yet armed before `min_tokens`), and their cache and prefill figures go to the `Migration` record,
  not to the request's usage;
- at most `limit` moves (`router.migration_limit`), then MIGRATION_LIMIT; a move that finds no pair to
  take it is MIGRATION_FAILED; a request that opted out (`GenerateRequest.no_migration`) gets the
  flow's own PEER_FAILED.

SGLang pairs take the same path (their decode streams the new prompt's first token itself); SGLang
seeds its sampling its own way, so a seeded SGLang request continues with the advanced seed but not
with the draws of the uninterrupted run, and SGLang engines declare no RESUMED_OUTPUT. Greedy
continuations are exact on either engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from xavier.v1 import error_reason_pb2 as er
from xavier.v1 import types_pb2

from xavier_core.runtime import Unavailable, XavierError, get_logger, wire_reasons
from xavier_core.sampling import advance_seed
from xavier_core.text.tokenizer import TextTokenizer
from xavier_services.router.flows import Step, StreamBroken
from xavier_services.router.health import peer_key
from xavier_services.router.request import Prepared
from xavier_services.router.seam_text import SeamText

_log = get_logger("xavier.router.migration")
_NO_PAIR = wire_reasons(er.ERROR_REASON_PEER_FAILED, er.ERROR_REASON_NO_PEERS)


@dataclass
class Migration:
    """One move of a request: why, from which peer, after how many tokens, and what the new prefill
    found cached of the new prompt (None until a step of the new attempt said, or when none did)."""

    cause: str
    peer_id: str
    tokens_sent: int
    prompt_tokens: int
    cached_tokens: int | None = None
    at: float = field(default_factory=time.monotonic)  # when the failure was seen
    seam_seconds: float | None = None  # from the failure to the new attempt's first token

    def first_step(self, step: Step) -> None:
        self.cached_tokens = step.cached_tokens
        self.seam_seconds = time.monotonic() - self.at

    def later_step(self, step: Step) -> None:
        """A later step of the new attempt: it may be the first to say what was cached (a concurrent
        pair's prefill answers beside the decode's stream)."""
        if self.cached_tokens is None:
            self.cached_tokens = step.cached_tokens

    def describe(self) -> str:
        """`cause:peer@tokens sent/cached=C of P new prompt tokens/seam=S s` (the request's log line)."""
        cached = "?" if self.cached_tokens is None else str(self.cached_tokens)
        seam = "?" if self.seam_seconds is None else f"{self.seam_seconds:.4f}"
        where = f"{self.cause}:{self.peer_id}@{self.tokens_sent}"
        return f"{where}/cached={cached}/of={self.prompt_tokens}/seam={seam}"


def resumed(prep: Prepared, sent: list[int], move: int) -> Prepared:
    """The request that continues `prep` after the client got `sent`: see the module's docstring."""
    s = types_pb2.SamplingParams()
    s.CopyFrom(prep.sampling)
    s.max_tokens = prep.sampling.max_tokens - len(sent)
    s.min_tokens = max(0, prep.sampling.min_tokens - len(sent))
    s.resumed_output_tokens = prep.sampling.resumed_output_tokens + len(sent)
    s.prompt_logprobs = False
    if s.HasField("seed"):
        s.seed = advance_seed(s.seed, len(sent))
    return dataclasses.replace(
        prep,
        request_id=f"{prep.request_id}.m{move}",
        token_ids=prep.token_ids + tuple(sent),
        sampling=s,
    )


def _refused(move: Migration, detail: str, *, reason: str, **metadata: object) -> Unavailable:
    """The client's error when `move` cannot happen (MIGRATION_LIMIT, MIGRATION_FAILED)."""
    return Unavailable(
        f"peer {move.peer_id!r} failed ({move.cause}) after {move.tokens_sent} tokens, and the request "
        + detail,
        reason=reason,
        peer_id=move.peer_id,
        cause=move.cause,
        tokens_sent=move.tokens_sent,
        **metadata,
    )


async def migrating(
    prep: Prepared,
    run: Callable[[Prepared, frozenset[str]], AsyncIterator[Step]],
    limit: int,
    tokenizer: TextTokenizer,
    moves: list[Migration],
) -> AsyncIterator[Step]:
    """The steps of `run(prep, avoid)`, resumed by `run(resumed(...), avoid)` after each broken stream
    (at most `limit` times), `avoid` holding every peer a stream broke on (a new epoch of it is another
    peer); each move is appended to `moves`."""
    sent: list[int] = []
    seam: SeamText | None = None
    current = prep
    broke_on: set[str] = set()
    while True:
        fresh = True  # nothing of this attempt reached the client yet
        try:
            async with aclosing(run(current, frozenset(broke_on))) as steps:  # type: ignore[type-var]
                async for step in steps:
                    if seam is not None:
                        if fresh:
                            moves[-1].first_step(step)
                        else:
                            moves[-1].later_step(step)
                        step = seam.render(step)
                    fresh = False
                    sent.extend(step.token_ids)
                    yield step
                    if step.finish:
                        return
            return
        except StreamBroken as broken:
            if not prep.migration:
                raise
            move = Migration(broken.cause, broken.peer.peer_id, len(sent), len(prep.token_ids) + len(sent))
            if len(moves) >= limit:
                detail = f"already moved {len(moves)} times (router.migration_limit)"
                raise _refused(move, detail, reason="MIGRATION_LIMIT", migrations=len(moves)) from None
            moves.append(move)
            broke_on.add(peer_key(broken.peer))
            _log.info(
                "migrating request",
                request_id=prep.request_id,
                peer_id=move.peer_id,
                cause=move.cause,
                tokens_sent=len(sent),
                migration=len(moves),
            )
            if seam is None:
                s = prep.sampling
                seam = SeamText(
                    tokenizer,
                    prep.token_ids,
                    sent,
                    s.stop,
                    min_tokens=s.min_tokens,
                    include=s.include_stop_str_in_output,
                )
            if len(sent) >= prep.sampling.max_tokens:  # the last token went out, its finish did not
                yield seam.length_end()
                return
            current = resumed(prep, sent, len(moves))
        except XavierError as err:
            # Past a move, a failover that found no pair (before the new decode's first token) is
            # the move failing too; other errors are the request's own.
            if not moves or not (fresh or err.reason in _NO_PAIR):
                raise
            detail = f"found no other pair to continue it ({err.reason})"
            if err.is_reason(er.ERROR_REASON_UNSUPPORTED_PARAMETER):  # the pair picked lacks RESUMED_OUTPUT
                detail = f"cannot continue exactly on the pair picked for it: {err.message}"
            raise _refused(moves[-1], detail, reason="MIGRATION_FAILED", why=err.reason) from None
