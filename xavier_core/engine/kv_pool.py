"""Paged KV pool in SGLang's MHA layout.

Per layer one K and one V tensor `[num_slots, kv_heads, head_dim]`; page p owns slots
[p*page_size, (p+1)*page_size). The tensors are allocated once and never reallocated: the transfer layer
registers their addresses (see `kv_buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xavier_core.engine.api import InvalidRequestError
from xavier_core.transfer.common.buffers import KvBuffer


class KvPool:
    """The KV tensors of every layer, addressed by page."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        if page_size <= 0 or num_pages <= 0:
            raise InvalidRequestError(f"page_size ({page_size}) and num_pages ({num_pages}) must be positive")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        slots = num_pages * page_size
        shape = (slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.bytes_per_page = page_size * num_kv_heads * head_dim * self.k[0].element_size()

    def buffers(self) -> list[torch.Tensor]:
        """The KV tensors in transfer order: layer0 K, layer0 V, layer1 K, ..."""
        out: list[torch.Tensor] = []
        for k, v in zip(self.k, self.v, strict=True):
            out += [k, v]
        return out

    def kv_buffers(self) -> list[KvBuffer]:
        """Address, length and page stride of every buffer, for registration with the transfer layer."""
        dev = str(self.device) if self.device.type != "cuda" else f"cuda:{self.device.index or 0}"
        return [
            KvBuffer(
                addr=t.data_ptr(),
                nbytes=t.numel() * t.element_size(),
                bytes_per_page=self.bytes_per_page,
                device=dev,
            )
            for t in self.buffers()
        ]

    def _pages_index(self, page_ids: Sequence[int]) -> torch.Tensor:
        bad = [p for p in page_ids if not 0 <= p < self.num_pages]
        if bad:
            raise InvalidRequestError(f"page ids out of range [0, {self.num_pages}): {bad[:8]}")
        return torch.tensor(list(page_ids), dtype=torch.long, device=self.device)

    def _paged(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.num_pages, -1).view(torch.uint8)

    def read_pages(self, page_ids: Sequence[int]) -> bytes:
        """Raw bytes of the pages, buffer by buffer (each buffer's pages in the given order)."""
        idx = self._pages_index(page_ids)
        parts = [self._paged(t).index_select(0, idx) for t in self.buffers()]
        return torch.cat([p.reshape(-1) for p in parts]).cpu().numpy().tobytes()

    def write_pages(self, page_ids: Sequence[int], data: bytes) -> None:
        """Inverse of `read_pages`: fills the pages from bytes laid out buffer by buffer."""
        idx = self._pages_index(page_ids)
        per_buffer = len(page_ids) * self.bytes_per_page
        bufs = self.buffers()
        if len(data) != per_buffer * len(bufs):
            raise InvalidRequestError(f"expected {per_buffer * len(bufs)} bytes, got {len(data)}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        for i, t in enumerate(bufs):
            chunk = src[i * per_buffer : (i + 1) * per_buffer].view(len(page_ids), self.bytes_per_page)
            self._paged(t).index_copy_(0, idx, chunk)

    def copy_pages_from(self, other: KvPool, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        """Copies pages tensor to tensor from another pool of the same layout (a local transfer)."""
        if len(src_pages) != len(dst_pages):
            raise InvalidRequestError("source and destination page lists differ in length")
        src_idx, dst_idx = other._pages_index(src_pages), self._pages_index(dst_pages)
        for s, d in zip(other.buffers(), self.buffers(), strict=True):
            self._paged(d).index_copy_(0, dst_idx, other._paged(s).index_select(0, src_idx).to(self.device))
