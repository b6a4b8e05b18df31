"""Turns a scheduled step into model inputs, and model logits into sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from xavier_core.engine.api import TopLogprobs
from xavier_core.engine.logits import adjust
from xavier_core.engine.model import ForwardBatch, PrefillSegment
from xavier_core.engine.request import Request, Sampled
from xavier_core.engine.scheduler import StepPlan
from xavier_core.grammar.masks import constrain
from xavier_core.sampling import step_seed

# The prompt positions of one step whose logits are wanted: (request, first position, batch offset, count).
PromptRows = list[tuple[Request, int, int, int]]


def _all_slots(pages: Sequence[int], length: int, page_size: int) -> torch.Tensor:
    base = torch.tensor(list(pages), dtype=torch.long).unsqueeze(1) * page_size
    return (base + torch.arange(page_size)).view(-1)[:length]


def prompt_rows(plan: StepPlan) -> PromptRows:
    """Where the step's prompt-logprob rows are: only requests that asked for prompt logprobs have any."""
    rows: PromptRows = []
    offset = 0
    for req, n in plan.items:
        wanted = req.prompt_positions(req.num_computed, n)
        if wanted:
            rows.append((req, wanted.start, offset + wanted.start - req.num_computed, len(wanted)))
        offset += n
    return rows


def build_batch(plan: StepPlan, page_size: int, device: torch.device, rows: PromptRows) -> ForwardBatch:
    """The flattened `ForwardBatch` of a step (decode items first, as the scheduler orders them); the
    logits of `rows` (`prompt_rows(plan)`) come after the sampled rows'."""
    ids: list[int] = []
    positions = _SlotList()
    out_slots = _SlotList()
    sample_idx: list[int] = []
    decode_rows: list[tuple[Sequence[int], int]] = []  # (pages, keys visible) of each decode item
    segments: list[PrefillSegment] = []
    for req, n in plan.items:
        start, stop = req.num_computed, req.num_computed + n
        offset = len(ids)
        ids += req.tokens[start:stop]
        if stop == len(req.tokens):
            sample_idx.append(offset + n - 1)
        if n == 1:  # one new slot, in plain integers: a tensor per decode row per step costs more
            positions.add(start)
            out_slots.add(req.pages[start // page_size] * page_size + start % page_size)
            decode_rows.append((req.pages, stop))
        else:
            positions.extend(torch.arange(start, stop))
            kv = _all_slots(req.pages, stop, page_size)
            out_slots.extend(kv[start:stop])
            segments.append(PrefillSegment(offset, n, start, kv.to(device, non_blocking=True)))
    batch = ForwardBatch(
        # Through NumPy: torch.tensor over a long list of ints costs 3-4x more (a 4,000-token chunk's
        # ids took 0.2 ms that way).
        input_ids=torch.from_numpy(np.array(ids, dtype=np.int64)).to(device, non_blocking=True),
        positions=positions.tensor().to(device, non_blocking=True),
        out_slots=out_slots.tensor().to(device, non_blocking=True),
        sample_idx=torch.tensor(sample_idx, dtype=torch.long).to(device, non_blocking=True),
        num_decode=len(decode_rows),
        segments=segments,
    )
    if rows:
        extra = [torch.arange(at, at + count) for _, _, at, count in rows]
        batch.prompt_idx = torch.cat(extra).to(device, non_blocking=True)
    if decode_rows:
        batch.decode_slots, batch.decode_mask = _decode_table(decode_rows, page_size, device)
    return batch


class _SlotList:
    """Slots (or positions) in batch order: decode rows' as integers, prefill chunks' as tensors, joined
    once."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._ints: list[int] = []

    def add(self, slot: int) -> None:
        self._ints.append(slot)

    def extend(self, slots: torch.Tensor) -> None:
        self._flush()
        self._parts.append(slots)

    def tensor(self) -> torch.Tensor:
        self._flush()
        if not self._parts:
            return torch.zeros(0, dtype=torch.long)
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)

    def _flush(self) -> None:
        if self._ints:
            self._parts.append(torch.tensor(self._ints, dtype=torch.long))
            self._ints = []


def _decode_table(
    rows: Sequence[tuple[Sequence[int], int]], page_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decode row's key slots `[B, width]` (zeros past its length) and its visibility mask, built
    from one padded page table for all rows."""
    lens = [length for _, length in rows]
    # Padding the width to a multiple of 64 keeps the set of attention shapes small.
    width = -(-max(lens) // 64) * 64
    num_pages = -(-width // page_size)
    pages = [list(p[: -(-length // page_size)]) for p, length in rows]
    table = torch.tensor([p + [0] * (num_pages - len(p)) for p in pages], dtype=torch.long)
    slots = (table.unsqueeze(2) * page_size + torch.arange(page_size)).view(len(rows), -1)[:, :width]
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    slots = slots.masked_fill(~mask, 0)
    return (
        slots.to(device, non_blocking=True),
        mask.view(len(rows), 1, 1, width).to(device, non_blocking=True),
    )


def _sample_one(logits: torch.Tensor, req: Request) -> torch.Tensor:
    s = req.sampling
    scaled = logits / s.temperature
    if s.top_k > 0 and s.top_k < scaled.numel():
        kth = torch.topk(scaled, s.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if s.min_p > 0.0:
        probs = probs.masked_fill(probs < s.min_p * probs.max(), 0.0)
    if s.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it is < top_p.
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= s.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    req.generator.manual_seed(step_seed(req.seed, len(req.output)))
    return torch.multinomial(probs, 1, generator=req.generator)


def _with_top(
    logprobs: torch.Tensor, ids: torch.Tensor, counts: Sequence[int]
) -> list[tuple[int, float, TopLogprobs | None]]:
    """Each row's token of `ids`, its logprob and its `counts[row]` most likely alternatives (none for a
    count of 0). One device-to-host copy: token ids are far below 2**53, so float64 carries them exactly."""
    k = max(counts, default=0)
    chosen = logprobs.gather(1, ids.unsqueeze(1))
    parts = [ids.double().unsqueeze(1), chosen.double()]
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        parts += [top.values.double(), top.indices.double()]
    host = torch.cat(parts, dim=1).cpu().tolist()
    out: list[tuple[int, float, TopLogprobs | None]] = []
    for row, n in zip(host, counts, strict=True):
        alts = None
        if n:
            alts = TopLogprobs(tuple(int(t) for t in row[2 + k : 2 + k + n]), tuple(row[2 : 2 + n]))
        out.append((int(row[0]), row[1], alts))
    return out


def sample(logits: torch.Tensor, reqs: Sequence[Request]) -> list[Sampled]:
    """One (token, logprob, alternatives) per request; logprobs are under the model's unscaled
    distribution, the alternatives (`top_logprobs` of them) only where the request asked. A request with
    a grammar samples only tokens the grammar allows, and one with logit controls (penalties,
    `logit_bias`, `min_tokens`: `engine.logits`) samples from its adjusted logits; the logprobs stay the
    model's."""
    if not reqs:
        return []
    logprobs = torch.log_softmax(logits, dim=-1)
    logits = adjust(logits, reqs)  # the same tensor when no request adjusts its logits
    logits = constrain(logits, [r.grammar for r in reqs])  # the same tensor when no request has a grammar
    tokens = torch.argmax(logits, dim=-1)
    for row, req in enumerate(reqs):
        if req.sampling.temperature > 0.0:
            tokens[row] = _sample_one(logits[row], req)[0]
    return _with_top(logprobs, tokens, [r.sampling.top_logprobs for r in reqs])


def record_prompt_logprobs(logits: torch.Tensor, rows: PromptRows) -> None:
    """Gives each request of `rows` the logprobs of its prompt tokens after the positions computed;
    `logits` are the prompt rows' (in `rows` order), position p's scoring prompt token p + 1."""
    targets = [req.prompt[p + 1] for req, first, _, count in rows for p in range(first, first + count)]
    counts = [req.sampling.top_logprobs for req, _, _, count in rows for _ in range(count)]
    ids = torch.tensor(targets, dtype=torch.long).to(logits.device, non_blocking=True)
    values = iter(_with_top(torch.log_softmax(logits, dim=-1), ids, counts))
    for req, first, _, count in rows:
        for position in range(first, first + count):
            _, logprob, top = next(values)
            req.record_prompt(position, logprob, top)
