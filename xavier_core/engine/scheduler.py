"""Continuous batching: waiting/running queues, chunked prefill, preemption by recompute.

Each step computes, for every scheduled request, a run of its not-yet-computed tokens: one token for a
request in decode, a chunk for a request in prefill. Running requests are served first (decodes cost one
token of the step budget each); waiting requests are admitted while the budget, the running limit and the
pool allow. When a running request needs a page and none is left, the most recently admitted request is
preempted: its pages are released and it goes back to the front of the waiting queue, to be recomputed
(often from the prefix cache) when there is room again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from xavier_core.engine.api import FinishReason, OutOfPagesError, TokenEvent
from xavier_core.engine.prefix_cache import PrefixCache
from xavier_core.engine.request import Delivery, Request, Role, Sampled, pages_for
from xavier_core.prefix_keys import page_keys


@dataclass
class StepPlan:
    """The requests of one forward step and how many tokens each computes."""

    items: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def sampling(self) -> list[Request]:
        """Requests whose chunk reaches their last token, i.e. that sample this step, in batch order."""
        return [r for r, n in self.items if r.num_computed + n == len(r.tokens)]


class Scheduler:
    """Owns the queues; every method runs on the engine loop thread under the engine lock."""

    def __init__(self, cache: PrefixCache, max_running: int, chunk_tokens: int) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_cached_store = 0
        self.preemptions = 0
        # Called (engine thread, lock held) when a prefill or generate request's prompt is fully computed,
        # before its first token is accepted: its pages are all there and not yet released.
        self.on_prompt_done: Callable[[Request], None] | None = None
        # With a page store: a generating request's output pages, after each step (final: it finished).
        self.on_output_pages: Callable[[Request, bool], None] | None = None

    def add(self, req: Request) -> None:
        """Queues a new request."""
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        """The live request with that id, if any."""
        for req in (*self.running, *self.waiting):
            if req.id == request_id:
                return req
        return None

    def schedule(self) -> tuple[StepPlan, list[tuple[Request, Delivery]]]:
        """Picks the next step's work; also returns failures of requests that can never fit."""
        plan = StepPlan()
        failed: list[tuple[Request, Delivery]] = []
        budget = self.chunk_tokens
        i = 0
        while i < len(self.running):
            req = self.running[i]
            # A decode always runs (one token); prefill chunks share what is left of the budget.
            n = 1 if req.remaining == 1 else min(req.remaining, budget)
            if n > 0:
                if not self._grow(req, req.num_computed + n):
                    break  # req itself was preempted; everything after it already was
                plan.items.append((req, n))
                budget = max(0, budget - n)
            i += 1
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[0]
            if not req.pages and req.chain_seed is not None:
                self._match_prefix(req)
            capacity = (len(req.pages) + self.cache.available()) * self.page_size - req.num_computed
            n = min(req.remaining, budget, capacity)
            if n <= 0:
                if self.running:
                    self._drop_pages(req)  # keep nothing idle while waiting for room
                    break
                self.waiting.popleft()
                self._drop_pages(req)
                failed.append((req, OutOfPagesError(f"request {req.id} does not fit in the KV pool")))
                continue
            self.waiting.popleft()
            self._grow(req, req.num_computed + n)
            req.admitted = True
            self.running.append(req)
            plan.items.append((req, n))
            budget -= n
        # Decodes first: the model batches single-token queries together at the front of the batch.
        plan.items.sort(key=lambda item: item[1] != 1)
        return plan, failed

    def complete(self, plan: StepPlan, sampled: Sequence[Sampled]) -> list[tuple[Request, Delivery]]:
        """Advances the requests of a finished step and returns what to deliver to their callers."""
        out: list[tuple[Request, Delivery]] = []
        samples = iter(sampled)
        for req, n in plan.items:
            prompt_left = max(0, min(len(req.prompt), req.num_computed + n) - req.num_computed)
            if req.role is not Role.DECODE:
                self.prompt_tokens_computed += prompt_left
            req.num_computed += n
            self._register_pages(req)
            if req.num_computed < len(req.tokens):
                continue
            if req.role is not Role.DECODE and not req.output and self.on_prompt_done is not None:
                self.on_prompt_done(req)
            event = req.accept(*next(samples))
            if req.role is Role.PREFILL:
                self.running.remove(req)
                self.cache.allocator.pin(req.id, req.pages)
                out.append((req, req.prefill_result(event)))
                req.pages = []
                req.finish = event.finish or FinishReason.LENGTH
                continue
            out.append((req, event))
            if self.on_output_pages is not None:  # generating or decoding (a prefill ended above)
                self.on_output_pages(req, event.finish is not None)
            if event.finish is not None:
                self.running.remove(req)
                self._drop_pages(req)
        return out

    def abort(self, request_id: str) -> Request | None:
        """Removes a live request and frees its pages; returns it (its caller still needs telling)."""
        req = self.find(request_id)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._drop_pages(req)
        req.finish = FinishReason.ABORT
        return req

    def fail_all(self) -> list[Request]:
        """Removes every live request (engine shutdown or a failed step) and frees their pages."""
        reqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        for req in reqs:
            self._drop_pages(req)
        return reqs

    def accept_first_token(self, req: Request, token: int, logprob: float) -> TokenEvent:
        """Decode role: the transferred request starts with a known first token."""
        event = req.accept(token, logprob)
        if event.finish is not None:
            self._drop_pages(req)
        return event

    def adopt_prefix(self, req: Request, pages: list[int], store_pages: int) -> None:
        """A request not yet queued takes a prefix matched before admission: `pages` (one reference each,
        now the request's) hold its first full prompt pages, the last `store_pages` of them fetched from
        the page store (and registered in the local cache)."""
        p = self.page_size
        req.pages = pages
        req.num_registered = len(pages)
        req.num_computed = len(pages) * p
        hit = min(req.num_computed, len(req.prompt))
        store = min(store_pages * p, hit)
        self.prompt_tokens_cached += hit
        self.prompt_tokens_cached_store += store
        req.cached_tokens, req.cached_tokens_store = hit, store

    def _match_prefix(self, req: Request) -> None:
        # A request that wants its prompt's logprobs computes every prompt position (it still fills the
        # cache for others).
        if req.chain_seed is None or req.prompt_positions(0, len(req.prompt)):
            return
        if not req.prompt_keys:
            req.prompt_keys = page_keys(req.chain_seed, req.prompt, self.page_size)
        # At least one token must be computed: the last one's logits give the next token.
        max_pages = (len(req.tokens) - 1) // self.page_size
        pages = self.cache.match(req.prompt_keys, req.tokens, max_pages)
        req.pages = pages
        req.num_registered = len(pages)
        req.num_computed = len(pages) * self.page_size
        hit = min(req.num_computed, len(req.prompt))
        self.prompt_tokens_cached += hit
        if not req.admitted:
            req.cached_tokens = hit
            req.cached_tokens_store = min(req.cached_tokens_store, hit)

    def _register_pages(self, req: Request) -> None:
        if req.chain_seed is None:
            return
        full = req.num_computed // self.page_size
        p = self.page_size
        while req.num_registered < full:
            i = req.num_registered
            if i < len(req.prompt_keys):
                key = req.prompt_keys[i]
            else:
                prev = req.prompt_keys[i - 1] if i else req.chain_seed
                key = page_keys(prev, req.tokens[i * p : (i + 1) * p], p)[0]
                req.prompt_keys.append(key)
            self.cache.insert(key, req.pages[i], req.tokens[i * p : (i + 1) * p])
            req.num_registered += 1

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Gives `req` pages for `num_tokens` tokens, preempting from the back; False if req was preempted."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        while need > self.cache.available():
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.cache.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_pages(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _drop_pages(self, req: Request) -> None:
        self.cache.release(req.pages)
        req.pages = []
        req.num_computed = 0
        req.num_registered = 0
