"""A stand-in for `CausalLM` whose compute is close to zero, for measuring the overhead around the model.

Everything else in the engine stays real: scheduling, paging, the KV pool, the prefix cache, sampling and
the engine loop. `NullLM.forward` still writes every layer's K and V into the pool, with values derived
from each token's id and position (and the layer), so pages moved between peers carry checkable content.
Its logits make greedy decoding follow one rule: after token `t` comes `(t * 7 + 1) % vocab_size`.
"""

from __future__ import annotations

import torch

from xavier_core.engine.checkpoint import ModelConfig
from xavier_core.engine.kv_pool import KvPool
from xavier_core.engine.model import ForwardBatch

_KV_MODULUS = 251  # prime: distinct (token, position) pairs spread over many values
_LAYER_STRIDE = 17  # offset between consecutive buffers (layer0 K, layer0 V, layer1 K, ...)


def null_next_token(token: int, vocab_size: int) -> int:
    """The greedy successor of `token` under `NullLM`."""
    return (token * 7 + 1) % vocab_size


class NullLM:
    """Same surface as `CausalLM` towards the engine (`cfg`, `device`, `dtype`, `forward`), no weights.

    There is no `decode_static`: the engine must not build a decode-graph runner around it.
    """

    def __init__(self, cfg: ModelConfig, device: str, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        # Per-buffer offsets, [2 * layers, 1]: one vectorised op gives every buffer's values at once.
        self._offsets = (torch.arange(2 * cfg.num_layers, dtype=torch.long) * _LAYER_STRIDE).unsqueeze(1)
        self._offsets = self._offsets.to(self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KvPool) -> torch.Tensor:
        """Writes K/V of every layer at `out_slots`; float32 logits `[S + P, vocab]` with one 1.0 per row.

        Buffer `b` (K of layer i is 2i, V is 2i+1) gets `((id * 31 + position + 17 * b) % 251) / 251` in
        every head and channel of the token's slot.
        """
        base = batch.input_ids * 31 + batch.positions  # [T]
        values = ((base + self._offsets) % _KV_MODULUS).float().div_(_KV_MODULUS).to(self.dtype)
        values = values.view(values.shape[0], -1, 1, 1)  # [2L, T, 1, 1], broadcast over heads x head_dim
        slots = batch.out_slots
        for i, (k_buf, v_buf) in enumerate(zip(pool.k, pool.v, strict=True)):
            k_buf[slots] = values[2 * i]
            v_buf[slots] = values[2 * i + 1]
        vocab = self.cfg.vocab_size
        last = batch.input_ids[batch.logit_rows()]  # [S + P]
        logits = torch.zeros(last.shape[0], vocab, dtype=torch.float32, device=self.device)
        return logits.scatter_(1, ((last * 7 + 1) % vocab).unsqueeze(1), 1.0)
