"""The engine-neutral interface the services call.

The reference engine (`xavier_core.engine.reference`) implements `Engine`; any other engine a peer serves
must offer the same members. Pages are engine KV pages in SGLang's MHA layout: per layer one K and one V
buffer `[num_slots, kv_heads, head_dim]`, page p owning slots [p*page_size, (p+1)*page_size). The transfer
layer only needs `kv_buffers()`, page ids and the optional `device_lock`.

Engine errors are plain exceptions: the engine knows nothing of gRPC. The service runtime maps them to
statuses in one place (`xavier_core.runtime.domain_errors`).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from xavier_core.grammar import GrammarSpec
from xavier_core.sampling import check_sampling
from xavier_core.transfer.common.buffers import KvBuffer

if TYPE_CHECKING:
    import asyncio

    from xavier_core.engine.store_link import SharePull
    from xavier_core.pagestore.client import PageStoreClient


class EngineError(Exception):
    """Base class of engine errors (a failure of the engine itself when no subclass fits)."""


class InvalidRequestError(EngineError):
    """The request cannot be served as asked (empty prompt, too long, bad sampling values)."""


class ResumedOutputError(InvalidRequestError):
    """A resumed request's output so far (`Sampling.resumed_output_tokens`) does not follow its grammar,
    or already completes it."""


class OutOfPagesError(EngineError):
    """The KV pool cannot hold the request even after eviction and preemption."""


class EngineBusyError(EngineError):
    """The engine already holds its bound of requests waiting for their first step; retry later or
    elsewhere. Nothing of the refused request was kept."""


class RequestNotFoundError(EngineError):
    """No live request with that id."""


class EngineFeature(enum.Enum):
    """A request feature an engine may or may not honour (`Engine.features`); peers declare theirs in
    `KvLayout.features` and the router refuses a request that needs one its chosen peer lacks."""

    TOP_LOGPROBS = "top_logprobs"  # `Sampling.top_logprobs` alternatives beside each token
    PROMPT_LOGPROBS = "prompt_logprobs"  # `Sampling.prompt_logprobs`: the prompt tokens' logprobs
    STRUCTURED_OUTPUT = "structured_output"  # `Sampling.grammar`: every token follows the grammar
    PENALTIES = "penalties"  # presence, frequency and repetition penalties
    LOGIT_BIAS = "logit_bias"  # `Sampling.logit_bias` added to the logits
    MIN_TOKENS = "min_tokens"  # no stopping token before `Sampling.min_tokens`
    MIN_P = "min_p"  # `Sampling.min_p` cut when sampling
    STOP_STRING_IN_OUTPUT = "stop_string_in_output"  # `Sampling.include_stop_str_in_output`
    # `Sampling.resumed_output_tokens`: the prompt's tail counts as output for the presence and
    # frequency penalties and advances the grammar
    RESUMED_OUTPUT = "resumed_output"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling. temperature 0 means greedy; seed makes sampling reproducible."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives returned beside each token (0..MAX_TOP_LOGPROBS)
    prompt_logprobs: bool = False  # return the prompt tokens' logprobs (the whole prompt is computed)
    grammar: GrammarSpec | None = None  # constrains every token sampled (compiled by the engine)
    # Logit controls (`xavier_core.engine.logits`): presence and frequency count the output's tokens,
    # repetition the prompt's and the output's (vLLM's definitions); the default values are off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), added before the penalties
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
    min_p: float = 0.0  # sampling drops tokens below min_p x the most likely one's probability
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    # The prompt's last tokens that an earlier attempt of the request already produced (a migrated
    # request): presence and frequency penalties count them and the grammar's matcher accepts them
    # before the first new token; max_tokens and min_tokens count new tokens only. Below the prompt's
    # length (`ReferenceEngine` checks it against the prompt).
    resumed_output_tokens: int = 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a step must change this request's logits before sampling (`engine.logits`)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def check(self) -> None:
        """Raises `xavier_core.sampling.SamplingError` naming the first value outside the shared limits."""
        check_sampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            top_logprobs=self.top_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias),
            min_tokens=self.min_tokens,
            min_p=self.min_p,
        )


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one position and their logprobs, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class PromptLogprobs:
    """`logprobs[i]` is prompt token i + 1's logprob under tokens 0..i; `top[i]` the alternatives there
    (empty when the request asked for none)."""

    logprobs: tuple[float, ...]
    top: tuple[TopLogprobs, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `finish` (STOP or LENGTH) is set on the last token of a request."""

    token_id: int
    logprob: float
    finish: FinishReason | None = None
    # Text delta for this token (incremental detokenization; may be "" while a UTF-8 char is incomplete).
    text: str = ""
    # Prompt tokens not computed: served from the local prefix cache or the page store (the store's share
    # in `cached_tokens_store`). Set on a request's first token only.
    cached_tokens: int = 0
    cached_tokens_store: int = 0
    # The alternatives at this token's position, when `Sampling.top_logprobs` asked for them.
    top: TopLogprobs | None = None
    # The prompt's logprobs, on a generate request's first token when `Sampling.prompt_logprobs`.
    prompt: PromptLogprobs | None = None


@dataclass(frozen=True)
class AbortEvent:
    """The last event of an aborted request: it carries no token and no text."""

    finish: Literal[FinishReason.ABORT] = FinishReason.ABORT


# What a token stream yields: tokens, and for an aborted request an `AbortEvent` last.
StreamEvent = TokenEvent | AbortEvent


@dataclass(frozen=True)
class PrefillResult:
    """Outcome of a prefill-only request: its pages stay pinned until `release_pages(request_id)`."""

    first_token: int
    first_logprob: float
    page_ids: tuple[int, ...]  # ceil(prompt_len / page_size) pages holding the prompt's KV, in order
    prompt_tokens: int
    cached_tokens: int  # prompt tokens not computed: local prefix cache plus page store
    finish: FinishReason | None = None  # set if the first token already ends the request (EOS, max_tokens=1)
    text: str = ""  # the first token's text (stop strings applied; flushed when `finish` is set)
    cached_tokens_store: int = 0  # the page store's share of `cached_tokens`
    first_top: TopLogprobs | None = None  # the first token's alternatives, when asked for
    prompt_logprobs: PromptLogprobs | None = None  # when `Sampling.prompt_logprobs`


@dataclass(frozen=True)
class StoreStats:
    """What an engine's page store link did since it started, in pages."""

    hit_pages: int = 0  # fetched into the pool and verified
    pages_written: int = 0  # written through and committed
    writes_dropped: int = 0  # write-throughs dropped on a full queue
    errors: int = 0  # store calls that failed and were served as a miss


@dataclass(frozen=True)
class EngineStats:
    pages_total: int
    pages_free: int
    pages_pinned: int
    running: int
    waiting: int
    pages_quarantined: int = 0  # out of use while a read into them may still run (`quarantine_pages`)
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0  # local prefix cache plus page store
    prompt_tokens_cached_store: int = 0  # the page store's share of `prompt_tokens_cached`
    store: StoreStats | None = None  # None when no page store is attached
    extra: dict[str, int] = field(default_factory=dict)


class Engine(Protocol):
    """What a prefill, decode or unified service needs from an engine: every member a service uses."""

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        ...

    @property
    def max_context(self) -> int:
        """Longest prompt plus output a request may reach."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts: [0, vocab_size)."""
        ...

    @property
    def dtype_name(self) -> str:
        """KV dtype as a short name ("float16", "bfloat16", "float32"), part of the KV layout."""
        ...

    @property
    def features(self) -> frozenset[EngineFeature]:
        """The optional request features this engine honours; it refuses the others."""
        ...

    @property
    def device_lock(self) -> threading.Lock | None:
        """Held by callers around their own device work (KV transfers) so it never overlaps a CUDA graph
        capture; None when the engine needs no such exclusion."""
        ...

    def kv_buffers(self) -> list[KvBuffer]:
        """The registered KV buffers, stable for the engine's lifetime."""
        ...

    def capture_decode_graphs(self) -> int:
        """Captures decode CUDA graphs now, before any transfer agent uses the device; returns how many
        (0 for an engine without graphs). Short prefill chunks after cached keys replay them too."""
        ...

    def generate(
        self, request_id: str, token_ids: Sequence[int], sampling: Sampling, *, cache_salt: str = ""
    ) -> AsyncIterator[StreamEvent]:
        """Runs a whole request (unified/colocated role) and streams its tokens."""
        ...

    async def prefill(
        self, request_id: str, token_ids: Sequence[int], sampling: Sampling, *, cache_salt: str = ""
    ) -> PrefillResult:
        """Computes the prompt's KV and samples the first token; the pages stay pinned."""
        ...

    def pin_prefix(
        self, owner: str, token_ids: Sequence[int], cache_salt: str = "", first_page: int = 0
    ) -> tuple[int, ...]:
        """Pins the cached pages of the longest run of `token_ids`' full pages from `first_page` on (keys
        under `cache_salt`) for `owner` (an id no request uses) until `release_pages(owner)`; () when
        none is cached."""
        ...

    def release_pages(self, request_id: str) -> None:
        """Unpins the pages of a prefill or a pinned prefix (or frees the reserved pages of a decode).
        Idempotent."""
        ...

    def quarantine_pages(self, request_id: str, until: asyncio.Future[None] | None = None) -> int:
        """Takes the request's pinned pages out of use (a read into them may still be running) until
        `until` completes (the read ended), for good without it; returns how many. Idempotent."""
        ...

    def reserve_pages(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Allocates destination pages for `num_tokens` prompt tokens (decode role) before the KV arrives."""
        ...

    def decode_from_pages(
        self,
        request_id: str,
        token_ids: Sequence[int],
        first_token: int,
        first_logprob: float,
        sampling: Sampling,
        cache_salt: str = "",
    ) -> AsyncIterator[StreamEvent]:
        """Continues a request whose prompt KV was written into its reserved pages.

        The first event is `first_token` itself; generation continues from it. `cache_salt` names the
        tenant the answer's pages belong to (an engine with a page store writes them through under it).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stops a request; its generate/decode stream ends with an `AbortEvent`. Never blocks the loop."""
        ...

    def stats(self) -> EngineStats: ...

    def use_page_store(
        self,
        store: PageStoreClient,
        contract_fingerprint: str,
        share: SharePull | None = None,
        stand_s: float = 0.0,
        stand_share: float = 0.0,
    ) -> None:
        """Shares full prompt pages across replicas through `store` (pages of namespace
        `contract_fingerprint` + the request's cache salt): before computing a prompt, the engine fetches
        the longest stored prefix beyond its local cache; after it, it writes computed pages through. The
        store can only make requests faster: its trouble is a miss, never a failed request. With `share`,
        stored pages another replica wrote are first asked of that replica's pool (`store_link.SharePull`),
        and the pages this one writes stand in its pool for `stand_s` seconds (at most `stand_share` of
        the pool at once), where other replicas copy them without asking. Call once, from the event loop
        the requests run on."""
        ...

    def read_pages(self, page_ids: Sequence[int]) -> bytes:
        """Returns the raw KV bytes of the pages, buffer by buffer (tests compare P/D bytes bitwise)."""
        ...

    async def close(self) -> None: ...
