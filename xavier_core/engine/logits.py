"""The logit controls of a sampling step: `min_tokens`, `logit_bias` and the three penalties.

Only requests whose `Sampling.adjusts_logits` is set pay anything: a step none of whose requests asks
returns the model's logits tensor untouched. The order is vLLM's: stopping tokens are masked while the
output is shorter than `min_tokens`, then `logit_bias` is added, then repetition, frequency and presence
penalties apply; temperature, `min_p`, top-k and top-p come after, in the sampler.

What the penalties count, as vLLM and OpenAI define them: presence and frequency count the tokens of the
output (the first one included; a resumed request's `Sampling.resumed_output_tokens`, the prompt's tail
an earlier attempt produced, too), repetition every token of the prompt and of the output. A request's
counts (`TokenHistory`) are built from its tokens the first time a step needs them and then follow each
token it accepts, so a P/D decode (whose output starts with the prefill's first token) continues the very
state the prefill sampled that first token under.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from xavier_core.engine.request import Request


class TokenHistory:
    """One request's token counts on the logits' device: how often each id is in the output, and
    (only with a repetition penalty) which ids are in the prompt or the output."""

    def __init__(
        self, prompt: Sequence[int], output: Sequence[int], vocab: int, device: torch.device
    ) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if output:
            ids = torch.tensor(list(output), dtype=torch.long, device=device)
            self.counts.index_add_(0, ids, torch.ones(len(output), device=device))
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor([*prompt, *output], dtype=torch.long, device=device)] = True

    def add(self, token: int) -> None:
        """Counts one more output token."""
        self.counts[token] += 1.0
        self.seen[token] = True


def adjust(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """`logits` (one row per request) after each request's controls; the same tensor when no request
    has any. The model's own logits are never written: a step that adjusts works on a copy."""
    rows = [row for row, req in enumerate(reqs) if req.sampling.adjusts_logits]
    if not rows:
        return logits
    out = logits.float().clone()
    for row in rows:
        out[row] = _adjust_row(out[row], reqs[row])
    return out


def _adjust_row(row: torch.Tensor, req: Request) -> torch.Tensor:
    s = req.sampling
    if len(req.output) < s.min_tokens:
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(req.eos_ids))
        ids = [t for t in stops if t < row.numel()]
        if ids:
            row[torch.tensor(ids, dtype=torch.long, device=row.device)] = float("-inf")
    if s.logit_bias:
        biased = torch.tensor([t for t, _ in s.logit_bias], dtype=torch.long, device=row.device)
        row.index_add_(0, biased, torch.tensor([b for _, b in s.logit_bias], device=row.device))
    if not (s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0):
        return row
    if req.history is None:
        req.history = TokenHistory(req.prompt, req.resumed + req.output, row.numel(), row.device)
    h = req.history
    if s.repetition_penalty != 1.0:
        penalized = torch.where(row > 0, row / s.repetition_penalty, row * s.repetition_penalty)
        row = torch.where(h.seen, penalized, row)
    if s.frequency_penalty:
        row = row - s.frequency_penalty * h.counts
    if s.presence_penalty:
        row = row - s.presence_penalty * (h.counts > 0).float()
    return row
