"""Auxiliary slots: small per-request buffers that travel beside the KV pages over the same NIXL agent.

An engine may keep per-request data outside its KV pool: SGLang's prefill writes the first output token
and its metadata into "aux" buffers, one slot per request (`aux_index`), and the decode needs those bytes
too. The transfer layer models them exactly like KV buffers (`KvBuffer`: one slot is one "page") but as a
second group, addressed by slot ids instead of page ids, so a room's READ of its pages and of its slot
never mix layouts.

`AuxNixlAgent` is a `NixlAgent` that also registers the aux group (before its metadata is taken, so one
metadata blob describes both groups) and READs slots. The wire form: the endpoint's `aux_regions` and
the source descriptor's `aux_runs` (see `aux_endpoint_regions` and `aux_from_proto`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.transfer import runs
from xavier_core.transfer.buffers import KvBuffer
from xavier_core.transfer.errors import InvalidPagesError, InvalidSourceError, LayoutError
from xavier_core.transfer.nixl_backend import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    NixlAgent,
    _dlist,
    check_buffers,
    register_buffers,
)
from xavier_core.transfer.source import MAX_BUFFERS, MAX_DEVICE_CHARS
from xavier_core.transfer.xfer import Transfer

__all__ = ["AuxNixlAgent", "aux_endpoint_regions", "aux_from_proto"]


class AuxNixlAgent(NixlAgent):
    """A `NixlAgent` whose registration also covers `aux_buffers` (each cut into equal slots)."""

    def __init__(
        self,
        name: str,
        buffers: Sequence[KvBuffer],
        aux_buffers: Sequence[KvBuffer],
        progress_thread: bool = False,
        *,
        backend: str = "UCX",
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        super().__init__(
            name, buffers, progress_thread, backend=backend, transfer_timeout_s=transfer_timeout_s
        )
        self.aux_buffers = tuple(aux_buffers)
        self._aux_reg: object | None = None
        if not self.aux_buffers:
            return
        try:
            self.aux_mem = check_buffers(self.aux_buffers, "local aux")
            self._aux_reg = register_buffers(self.raw, self.aux_buffers, self.aux_mem)
        except BaseException:
            super().close()
            raise
        # The metadata taken by the base class predates the aux registration: peers need both groups.
        self._metadata = self.raw.metadata()

    @property
    def num_slots(self) -> int:
        return min((b.num_pages for b in self.aux_buffers), default=0)

    def read_slots(
        self,
        peer_key: str,
        remote_aux: Sequence[KvBuffer],
        src_slots: Sequence[int] | npt.NDArray[np.integer],
        dst_slots: Sequence[int] | npt.NDArray[np.integer],
        notif: bytes = b"",
        timeout_s: float | None = None,
    ) -> Transfer:
        """READs remote slots `src_slots[i]` into local slots `dst_slots[i]` of every aux buffer."""
        if not self.aux_buffers:
            raise LayoutError("this agent registered no aux buffers")
        remote_mem = check_buffers(remote_aux, f"peer {peer_key} aux")
        if len(remote_aux) != len(self.aux_buffers):
            raise LayoutError(
                f"aux buffer count differs: peer {len(remote_aux)}, local {len(self.aux_buffers)}"
            )
        for i, (r, mine) in enumerate(zip(remote_aux, self.aux_buffers, strict=True)):
            if r.bytes_per_page != mine.bytes_per_page:
                raise LayoutError(
                    f"aux buffer {i}: slot size differs "
                    f"(peer {r.bytes_per_page}, local {mine.bytes_per_page})"
                )
        src = runs.as_page_array(src_slots)
        dst = runs.as_page_array(dst_slots)
        remote_slots = min(b.num_pages for b in remote_aux)
        for pages, limit, side in ((src, remote_slots, "source"), (dst, self.num_slots, "destination")):
            if pages.size and int(pages.max()) >= limit:
                raise InvalidPagesError(f"{side} aux slot {int(pages.max())} is outside ({limit} slots)")
        table = runs.descriptors(
            [b.addr for b in remote_aux],
            [b.addr for b in self.aux_buffers],
            [b.bytes_per_page for b in self.aux_buffers],
            src,
            dst,
        )
        per = table.shape[0] // len(self.aux_buffers)
        local = _dlist(table[:, 1], table[:, 2], self.aux_buffers, per)
        remote = _dlist(table[:, 0], table[:, 2], remote_aux, per)
        return self._post_read(
            peer_key, local, self.aux_mem, remote, remote_mem, table, notif, timeout_s, "aux READ"
        )

    def close(self) -> None:
        """Like `NixlAgent.close`, and deregisters the aux group too. Idempotent."""
        with self.lock:
            try:
                super().close()
            finally:
                if self._aux_reg is not None:
                    try:
                        self.raw.deregister(self._aux_reg)
                    finally:
                        self._aux_reg = None


def aux_endpoint_regions(buffers: Sequence[KvBuffer]) -> list[types_pb2.MemoryRegion]:
    """The endpoint's `aux_regions` entries for `buffers`."""
    return [
        types_pb2.MemoryRegion(
            base_address=b.addr, length=b.nbytes, device=b.device, bytes_per_page=b.bytes_per_page
        )
        for b in buffers
    ]


def aux_from_proto(
    source: dpb.SourceDescriptor, endpoint: types_pb2.TransferEndpoint
) -> tuple[tuple[KvBuffer, ...], npt.NDArray[np.int64]]:
    """(remote aux buffers, source slot ids) of a descriptor and its endpoint from the network;
    `InvalidSourceError` names the bad field."""
    if len(endpoint.aux_regions) > MAX_BUFFERS:
        raise InvalidSourceError(f"endpoint.aux_regions: more than {MAX_BUFFERS}")
    for i, r in enumerate(endpoint.aux_regions):
        if not r.device or len(r.device) > MAX_DEVICE_CHARS:
            raise InvalidSourceError(f"endpoint.aux_regions[{i}].device: empty or too long")
        if r.bytes_per_page == 0 or r.length < r.bytes_per_page or r.base_address == 0:
            raise InvalidSourceError(f"endpoint.aux_regions[{i}]: invalid region")
    if source.aux_runs and not endpoint.aux_regions:
        raise InvalidSourceError("aux_runs: the source's endpoint has no aux_regions")
    buffers = tuple(
        KvBuffer(r.base_address, r.length, r.bytes_per_page, r.device) for r in endpoint.aux_regions
    )
    try:
        slots = runs.runs_to_pages(runs.PageRun(r.first_page, r.count) for r in source.aux_runs)
    except InvalidPagesError as exc:
        raise InvalidSourceError(f"aux_runs: malformed entry ({exc})") from exc
    return buffers, slots
