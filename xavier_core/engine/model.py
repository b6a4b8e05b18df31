"""Forward pass of Qwen2, Qwen3 and Llama decoder-only models over a paged KV pool.

One forward step handles a flattened batch of tokens from many requests: the linear layers run once over
all of them; attention runs batched for the decode tokens (one query each, keys gathered from the pool
with a padding mask) and per request for prefill chunks. `decode_static` is the same step with shapes
fixed by buckets, one query per row, for CUDA graphs (`decode_graph`): decode rows, and short prefill
chunks after cached keys as one row per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from xavier_core.engine.checkpoint import ModelConfig, RopeConfig
from xavier_core.engine.kv_pool import KvPool

# cuDNN attention builds an execution plan per new shape (tens of ms), and decode shapes change every step.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class PrefillSegment:
    """A prefill chunk of one request inside the flattened batch."""

    start: int  # offset of its first token in the flattened batch
    length: int  # tokens computed this step
    prefix_len: int  # tokens of the request already in the pool before this chunk
    kv_slots: torch.Tensor  # [prefix_len + length] pool slots of every position so far


@dataclass
class ForwardBatch:
    """Everything one forward step needs. Decode tokens come first in the flattened batch."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] pool slots where the new K/V go
    sample_idx: torch.Tensor  # [S] rows of the batch whose logits are wanted
    num_decode: int = 0
    # [P] more rows whose logits are wanted after `sample_idx`'s (prompt logprobs); None: none.
    prompt_idx: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None  # [B, Lmax] slots, padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] True where a key is visible
    segments: list[PrefillSegment] = field(default_factory=list)

    def logit_rows(self) -> torch.Tensor:
        """The rows whose logits a forward returns: `sample_idx`, then `prompt_idx`."""
        if self.prompt_idx is None:
            return self.sample_idx
        return torch.cat((self.sample_idx, self.prompt_idx))


@dataclass
class DecodeInputs:
    """A batch of rows with shapes fixed by its buckets: B rows (padded), P pages per row (padded).

    The page table has one row per row (R = B), or one for all (R = 1): the rows of one request's chunk
    share its pages, so its K/V are gathered once and each row is masked at its own length.
    Padding rows repeat a real row, so the K/V they write land in the same slot with the same values.
    """

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    out_slots: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] keys visible to each row, its new token included
    page_table: torch.Tensor  # [R, P] pool pages (R = B or 1); entries past a row's length are masked
    out_rows: torch.Tensor | None = None  # [S] the rows whose logits come back; None: every row


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with linear or llama3 scaling applied."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as the reference implementation: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Attention of one layer: `attend(q, k_buf, v_buf)` gives `[T, heads*head_dim]`."""


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


StaticLayer = Callable[..., torch.Tensor]
"""A layer of the static-shape step: `CausalLM.static_layer`, or what `CausalLM.compiled_layer` made of it."""


class CausalLM:
    """Weights of one model and its forward pass (inference only, no autograd)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([weights[a + f"{n}_proj.bias"] for n in "qkv"])
            self.layers.append(
                _Layer(
                    in_norm=weights[p + "input_layernorm.weight"],
                    post_norm=weights[p + "post_attention_layernorm.weight"],
                    qkv_w=torch.cat([weights[a + f"{n}_proj.weight"] for n in "qkv"]),
                    qkv_b=bias,
                    o_w=weights[a + "o_proj.weight"],
                    q_norm=weights.get(a + "q_norm.weight"),
                    k_norm=weights.get(a + "k_norm.weight"),
                    gate_up_w=torch.cat(
                        [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
                    ),
                    down_w=weights[p + "mlp.down_proj.weight"],
                )
            )
        freqs = torch.outer(torch.arange(cfg.max_position).float(), rope_inv_freq(cfg.rope, cfg.head_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.device)
        self.sin = emb.sin().to(self.device)
        self.scale = cfg.head_dim**-0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KvPool) -> torch.Tensor:
        """Writes the batch's K/V into the pool and returns float32 logits `[S + P, vocab]` of `sample_idx`
        then `prompt_idx`."""
        with sdpa_kernel(_SDPA_BACKENDS):
            return self._forward(batch, pool)

    def _forward(self, batch: ForwardBatch, pool: KvPool) -> torch.Tensor:
        h = self._layers(
            batch.input_ids,
            batch.positions,
            batch.out_slots,
            pool,
            partial(self._layer, attend=lambda q, k, v: self._attention(q, k, v, batch)),
        )
        last = _rms_norm(h[batch.logit_rows()], self.norm, self.cfg.rms_norm_eps)
        return F.linear(last, self.lm_head).float()

    @torch.inference_mode()
    def decode_static(self, inputs: DecodeInputs, pool: KvPool) -> torch.Tensor:
        """Float32 logits `[B, vocab]` (`[S, vocab]` with `out_rows`) of a batch of rows whose shapes depend
        only on its buckets.

        Every tensor the step creates has a shape fixed by `inputs`, and nothing reads back to the host,
        so the step can be captured in a CUDA graph and replayed with new values in the same buffers.
        Each layer writes every row's K/V before any row attends (`_layer`), so rows of one request at
        consecutive positions (a prefill chunk) see each other's keys as a causal prefill does.
        """
        return self.static_step(inputs, pool)

    def compiled_layer(self, backend: str = "inductor") -> StaticLayer:
        """`static_layer` compiled by `torch.compile` (with inductor, its elementwise work fused into a few
        kernels), shapes symbolic. Every layer has the same shapes, so one compilation serves them all, and
        a handful cover every bucket (each at the first step of its kind). Pass it to `static_step`, under
        `torch.no_grad()`: inference mode's tensors cannot be traced."""
        # Compilations are kept per function, and every model of a process compiles this one (its guards
        # on the model's shapes): room for a few models' handfuls before torch falls back to eager.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
        layer: StaticLayer = torch.compile(self.static_layer, backend=backend, dynamic=True)
        return layer

    def static_step(
        self, inputs: DecodeInputs, pool: KvPool, layer: StaticLayer | None = None
    ) -> torch.Tensor:
        """`decode_static` without its inference mode, each layer run by `layer` (`static_layer` unless
        given: `compiled_layer`'s)."""
        ps = pool.page_size
        tables, width = inputs.page_table.shape[0], inputs.page_table.shape[1] * ps
        slots = (inputs.page_table.unsqueeze(2) * ps + torch.arange(ps, device=self.device)).view(
            tables, width
        )
        hidden = torch.arange(width, device=self.device) >= inputs.seq_lens.unsqueeze(1)  # [B, L]
        bias = torch.zeros(hidden.shape, device=self.device).masked_fill(hidden, float("-inf"))
        run = partial(layer or self.static_layer, slots=slots, bias=bias)
        h = self._layers(inputs.input_ids, inputs.positions, inputs.out_slots, pool, run)
        if inputs.out_rows is not None:
            h = h.index_select(0, inputs.out_rows)
        return F.linear(_rms_norm(h, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    def static_layer(
        self,
        h: torch.Tensor,
        weights: _Layer,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        slots: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """One layer of `static_step`: `_layer` attending through `_paged_decode_attention`."""
        attend = partial(self._paged_decode_attention, slots=slots, bias=bias)
        return self._layer(h, weights, cos, sin, out_slots, k_buf, v_buf, attend)

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        pool: KvPool,
        layer: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states after the last layer, each run by `layer(h, weights, cos, sin, out_slots, k_buf,
        v_buf)`: `_layer` with its attention bound, or a static layer with its slots and bias."""
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].to(self.dtype).unsqueeze(1)
        sin = self.sin[positions].to(self.dtype).unsqueeze(1)
        for i, weights in enumerate(self.layers):
            h = layer(h, weights, cos, sin, out_slots, pool.k[i], pool.v[i])
        return h

    def _layer(
        self,
        h: torch.Tensor,
        layer: _Layer,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """Hidden states after one layer whose K/V buffers are `k_buf`, `v_buf`; `attend(q, k_buf, v_buf)`
        gives `[T, heads*head_dim]`."""
        cfg = self.cfg
        nq, nkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        eps = cfg.rms_norm_eps
        x = _rms_norm(h, layer.in_norm, eps)
        qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
        v = qkv[:, nq + nkv :].view(-1, cfg.num_kv_heads, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = _rotate(_rms_norm(qkv[:, :nq].view(-1, cfg.num_heads, d), layer.q_norm, eps), cos, sin)
            k = _rotate(
                _rms_norm(qkv[:, nq : nq + nkv].view(-1, cfg.num_kv_heads, d), layer.k_norm, eps),
                cos,
                sin,
            )
        else:  # one rotation over the query and key heads together: half the kernel launches
            qk = _rotate(qkv[:, : nq + nkv].view(-1, cfg.num_heads + cfg.num_kv_heads, d), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        # Every row's K/V of this layer land before any row attends: a prefill chunk run as decode rows
        # (`decode_static`) reads its earlier rows' keys from the pool.
        k_buf[out_slots] = k
        v_buf[out_slots] = v
        h = h + F.linear(attend(q, k_buf, v_buf), layer.o_w)
        x = _rms_norm(h, layer.post_norm, eps)
        gate, up = F.linear(x, layer.gate_up_w).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, layer.down_w)

    def _paged_decode_attention(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        slots: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """One query per row against the keys in its `slots` row, `[B, heads*head_dim]`, without expanding
        K/V.

        `slots` is `[R, L]`: R = B gives each row its own keys (decode rows of many requests), R = 1 gives
        every row the same keys (one request's chunk), gathered once. K/V are gathered head-major,
        `[KV, R, L, D]`, so both matmuls read them as they come; the queries of a KV head's group (times
        the B / R rows sharing a table) share one matmul against that head's keys. `bias` `[B, L]` (0, or
        -inf past a row's length) masks the page padding and, in a chunk, the keys after a row's own; the
        softmax runs in float32.
        """
        b, (r, width) = q.shape[0], slots.shape
        kv_heads, d = k_buf.shape[1], k_buf.shape[2]
        k = k_buf.transpose(0, 1)[:, slots]
        v = v_buf.transpose(0, 1)[:, slots]
        # Query head h reads KV head h // group: [KV, R, (B / R) * G, D], rows of a table then their heads.
        qg = (
            (q * self.scale)
            .view(r, b // r, kv_heads, -1, d)
            .permute(2, 0, 1, 3, 4)
            .reshape(kv_heads, r, -1, d)
        )
        scores = torch.matmul(qg, k.transpose(-1, -2)).view(kv_heads, r, b // r, -1, width)
        scores = scores + bias.view(1, r, b // r, 1, width)  # float16 + float32: float32
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kv_heads, r, -1, width)
        out = torch.matmul(probs, v).view(kv_heads, r, b // r, -1, d)  # [KV, R, B / R, G, D]
        return out.permute(1, 2, 0, 3, 4).reshape(b, -1)

    def _attention(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Attention output `[T, heads*head_dim]` for the flattened batch."""
        outs: list[torch.Tensor] = []
        nd = batch.num_decode
        if nd:
            if batch.decode_slots is None or batch.decode_mask is None:
                raise ValueError("decode batch without decode_slots/decode_mask")
            qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
            kd = k_buf[batch.decode_slots].transpose(1, 2)  # [B, KV, L, D]
            vd = v_buf[batch.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=batch.decode_mask, scale=self.scale, enable_gqa=True
            )
            outs.append(o.reshape(nd, -1))
        for seg in batch.segments:
            qs = q[seg.start : seg.start + seg.length].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ks = k_buf[seg.kv_slots].transpose(0, 1).unsqueeze(0)  # [1, KV, L, D]
            vs = v_buf[seg.kv_slots].transpose(0, 1).unsqueeze(0)
            if seg.prefix_len == 0:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                # The chunk's queries are the last `length` of `prefix_len + length` keys: a causal mask
                # aligned to the lower right, which CUDA's flash kernel takes as is (a boolean mask
                # would send it to the math kernel); on the CPU it is materialized.
                causal = causal_lower_right(seg.length, seg.prefix_len + seg.length)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=causal, scale=self.scale, enable_gqa=True
                )
            outs.append(o.squeeze(0).transpose(0, 1).reshape(seg.length, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
