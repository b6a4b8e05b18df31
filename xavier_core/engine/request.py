"""State of one request inside the engine loop, and its stop rules."""

from __future__ import annotations

import enum
import logging
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from xavier_core.engine.api import (
    AbortEvent,
    FinishReason,
    InvalidRequestError,
    PrefillResult,
    PromptLogprobs,
    ResumedOutputError,
    Sampling,
    TokenEvent,
    TopLogprobs,
)
from xavier_core.engine.logits import TokenHistory
from xavier_core.grammar.masks import TokenGrammar
from xavier_core.text.tokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer

_SEEDS = random.Random(secrets.randbits(64))
"""Seeds of requests that set none: drawn from one generator seeded once per process, where a system
call per request (`secrets`) was about 1.5% of a zero-compute peer's CPU samples."""

log = logging.getLogger(__name__)

# What the engine loop hands back to the asyncio side for one request.
Delivery = TokenEvent | AbortEvent | PrefillResult | BaseException
# One sampled token: its id, its logprob and (when the request asked for them) the alternatives.
Sampled = tuple[int, float, TopLogprobs | None]


class Role(enum.Enum):
    GENERATE = "generate"  # prompt in, tokens out
    PREFILL = "prefill"  # prompt in, first token out, pages pinned afterwards
    DECODE = "decode"  # prompt KV already in reserved pages, continues from a given first token


@dataclass(eq=False)
class Request:
    """A request's tokens, pages and output state. Only the engine loop thread mutates it."""

    id: str
    prompt: list[int]
    sampling: Sampling
    role: Role
    deliver: Callable[[Delivery], None]  # called on the engine thread; must only schedule work
    tokenizer: TextTokenizer
    eos_ids: frozenset[int]
    max_context: int
    chain_seed: bytes | None = None  # None: the request neither reads nor fills the prefix cache
    device: str = "cpu"
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in `pages`
    num_registered: int = 0  # leading full pages already offered to the prefix cache
    output_pages_written: int = 0  # leading full pages handed to the page store past the prompt's own
    cached_tokens: int = 0  # prompt tokens not computed on first admission (local cache + page store)
    cached_tokens_store: int = 0  # the page store's share of `cached_tokens`
    cache_salt: str = ""  # the tenant salt (names the request's page store namespace)
    admitted: bool = False
    # `time.perf_counter` when it was queued for the engine thread, when the first step that computes
    # any of it started and when the step that sampled its first output token ended (0: not yet); the
    # engine's first-token phases (`timing`) come from them.
    queued_at: float = 0.0
    scheduled_at: float = 0.0
    sampled_at: float = 0.0
    finish: FinishReason | None = None
    prompt_keys: list[bytes] = field(default_factory=list)
    # Prompt logprobs by position (entry i: prompt token i + 1), filled as the prompt's chunks compute.
    prompt_lps: list[tuple[float, TopLogprobs | None] | None] = field(default_factory=list)
    # The request's grammar matcher, when `sampling.grammar` is set (the engine compiles it before the
    # request is queued); it has accepted every token of `output`.
    grammar: TokenGrammar | None = None
    # The counts the penalties read, built at the first step that needs them (`engine.logits`).
    history: TokenHistory | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.seed = self.sampling.seed if self.sampling.seed is not None else _SEEDS.getrandbits(63)
        # Reseeded before each draw with `step_seed(seed, len(output))`: a token's randomness depends
        # on its position only, so a decode (whose first token came from the prefill) and a migrated
        # request at an advanced seed draw what one uninterrupted run would have.
        self.generator = torch.Generator(device=self.device)
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt)
        self._stop = StopMatcher(self.sampling.stop, include=self.sampling.include_stop_str_in_output)

    @property
    def resumed(self) -> list[int]:
        """The prompt's last `sampling.resumed_output_tokens` tokens: output an earlier attempt of this
        request produced, which the penalties count and the grammar has accepted."""
        return self.prompt[len(self.prompt) - self.sampling.resumed_output_tokens :]

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return len(self.tokens) - self.num_computed

    def prompt_positions(self, start: int, count: int) -> range:
        """Positions of a chunk [start, start + count) whose logits give a prompt logprob: those before
        the prompt's last token, while the prompt is still being computed and the request asked."""
        if not self.sampling.prompt_logprobs or self.output or self.role is Role.DECODE:
            return range(0)
        return range(start, min(start + count, len(self.prompt) - 1))

    def record_prompt(self, position: int, logprob: float, top: TopLogprobs | None) -> None:
        """Keeps the logprob of prompt token `position + 1` (a recomputed chunk writes the same values)."""
        if not self.prompt_lps:
            self.prompt_lps = [None] * (len(self.prompt) - 1)
        self.prompt_lps[position] = (logprob, top)

    def _prompt_logprobs(self) -> PromptLogprobs | None:
        if not self.sampling.prompt_logprobs:
            return None
        if len(self.prompt_lps) != len(self.prompt) - 1 or any(v is None for v in self.prompt_lps):
            raise InvalidRequestError(f"request {self.id}: prompt logprobs incomplete")  # an engine bug
        values = [v for v in self.prompt_lps if v is not None]
        tops = tuple(t for _, t in values if t is not None)
        return PromptLogprobs(tuple(lp for lp, _ in values), tops)

    def accept(self, token: int, logprob: float, top: TopLogprobs | None = None) -> TokenEvent:
        """Appends a sampled token, applies the stop rules and returns its event (the first one of a
        request that asked for prompt logprobs carries them)."""
        s = self.sampling
        prompt = self._prompt_logprobs() if not self.output and self.role is not Role.DECODE else None
        ended = self._follow_grammar(token)
        self.tokens.append(token)
        self.output.append(token)
        self.logprobs.append(logprob)
        if self.history is not None:
            self.history.add(token)
        # Before min_tokens nothing but the grammar stops the request (its stopping tokens are masked;
        # a decode's first token was sampled under the same mask).
        armed = len(self.output) > s.min_tokens
        stops = (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids
        if (armed and stops) or ended:
            # The stop token's own text is not output; bytes held back before it end as U+FFFD.
            self.finish = FinishReason.STOP
            text, _ = self._stop.feed(self._detok.flush())
            return TokenEvent(token, logprob, self.finish, text + self._stop.flush(), top=top, prompt=prompt)
        text, hit = self._stop.feed(self._detok.push(token), armed=len(self.output) >= s.min_tokens)
        if hit:
            self.finish = FinishReason.STOP
        elif len(self.output) >= s.max_tokens or len(self.tokens) >= self.max_context:
            self.finish = FinishReason.LENGTH
            tail, hit = self._stop.feed(self._detok.flush())
            text += tail if hit else tail + self._stop.flush()
            if hit:
                self.finish = FinishReason.STOP
        return TokenEvent(token, logprob, self.finish, text, top=top, prompt=prompt)

    def _follow_grammar(self, token: int) -> bool:
        """Advances the grammar by `token`; True when the grammar is done (its stop token accepted), which
        ends the request as EOS does. A decode's first token comes from its prefill: one the grammar
        refuses is refused here, before anything changed. A sampled token always follows the mask; if
        the grammar still refused it, the request stops rather than emit text outside the grammar."""
        if self.grammar is None:
            return False
        if self.grammar.accept(token):
            return self.grammar.terminated
        if self.role is Role.DECODE and not self.output:
            raise InvalidRequestError(f"request {self.id}: first token {token} does not follow its grammar")
        log.error("request %s: sampled token %d outside its grammar; stopping it", self.id, token)
        return True

    def replay_resumed(self) -> None:
        """Advances the request's fresh grammar over its resumed output (`resumed`), so the first new
        token is constrained where the earlier attempt stopped; output the grammar rejects, or that
        already completes it, is refused (`ResumedOutputError`)."""
        if self.grammar is None:
            return
        for i, token in enumerate(self.resumed):
            if not self.grammar.accept(token):
                raise ResumedOutputError(
                    f"request {self.id}: resumed output token {i} ({token}) does not follow its grammar"
                )
        if self.resumed and self.grammar.terminated:
            raise ResumedOutputError(f"request {self.id}: the resumed output already completes its grammar")

    def prefill_result(self, event: TokenEvent) -> PrefillResult:
        """The PrefillResult of a prefill-role request after its first token."""
        return PrefillResult(
            first_token=event.token_id,
            first_logprob=event.logprob,
            page_ids=tuple(self.pages),
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            finish=event.finish,
            text=event.text,
            cached_tokens_store=self.cached_tokens_store,
            first_top=event.top,
            prompt_logprobs=event.prompt,
        )


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_context: int) -> list[int]:
    """Validates prompt token ids, returning them as a list of ints.

    Checked in one vectorised pass (a message's repeated field or a list of 8,000 ids in a tenth of a
    millisecond, where a Python loop over them took half of one); ids NumPy cannot hold as int64 go the
    slow way, which names them."""
    try:
        arr = np.asarray(token_ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1:
        ids = [int(t) for t in token_ids]
        _check_ids(len(ids), max_context)
        bad = [t for t in ids if not 0 <= t < vocab_size]
    else:
        _check_ids(arr.size, max_context)
        out = (arr < 0) | (arr >= vocab_size)
        bad = arr[out][:8].tolist() if out.any() else []
        ids = arr.tolist()
    if bad:
        raise InvalidRequestError(f"token ids out of vocabulary [0, {vocab_size}): {bad[:8]}")
    return ids


def _check_ids(count: int, max_context: int) -> None:
    if not count:
        raise InvalidRequestError("empty prompt")
    if count >= max_context:
        raise InvalidRequestError(f"prompt has {count} tokens; the context limit is {max_context}")
