"""Auxiliary slots: small per-request buffers that travel beside the KV pages over the same NIXL agent.

An engine may keep per-request data outside its KV pool: SGLang's prefill writes the first output token
and its metadata into "aux" buffers, one slot per request (`aux_index`), and the decode needs those bytes
too. The transfer layer models them exactly like KV buffers (`KvBuffer`: one slot is one "page") but as a
second group, addressed by slot ids instead of page ids, so a room's READ of its pages and of its slot
never mix layouts.

`AuxNixlAgent` is a `NixlAgent` that also registers the aux group (`register_extra`: one metadata blob
describes both groups, and `close` deregisters both) and READs slots. The wire form: the endpoint's
`aux_regions` (written with `source.regions_proto`, like its `regions`) and the source descriptor's
`aux_runs` (read back with `aux_from_proto`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.transfer import runs
from xavier_core.transfer.buffers import KvBuffer
from xavier_core.transfer.errors import InvalidSourceError, LayoutError
from xavier_core.transfer.nixl_backend import DEFAULT_TRANSFER_TIMEOUT_S, NixlAgent, check_buffers
from xavier_core.transfer.source import MAX_BUFFERS, MAX_RUNS, buffers_from_regions, runs_from_proto
from xavier_core.transfer.xfer import Transfer

__all__ = ["AuxNixlAgent", "aux_from_proto"]


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
        if not self.aux_buffers:
            return
        try:
            self.aux_mem = self.register_extra(self.aux_buffers, "local aux")
        except BaseException:
            self.close()
            raise

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
        """READs remote slots `src_slots[i]` into local slots `dst_slots[i]` of every aux buffer, with the
        checks and descriptors of `NixlAgent.read` (a slot is a page of the aux group)."""
        if not self.aux_buffers:
            raise LayoutError("this agent registered no aux buffers")
        return self._read_group(
            self.aux_buffers, self.aux_mem, "aux", peer_key, remote_aux, src_slots, dst_slots, notif,
            "coalesced", timeout_s,
        )  # fmt: skip


def aux_from_proto(
    source: dpb.SourceDescriptor, endpoint: types_pb2.TransferEndpoint
) -> tuple[tuple[KvBuffer, ...], npt.NDArray[np.int64]]:
    """(remote aux buffers, source slot ids) of a descriptor and its endpoint from the network;
    `InvalidSourceError` names the bad field."""
    if len(endpoint.aux_regions) > MAX_BUFFERS:
        raise InvalidSourceError(f"endpoint.aux_regions: more than {MAX_BUFFERS}")
    buffers = buffers_from_regions(endpoint.aux_regions, "endpoint.aux_regions")
    if buffers:
        try:
            check_buffers(buffers, "endpoint.aux_regions")
        except LayoutError as exc:
            raise InvalidSourceError(str(exc)) from exc
    if not source.aux_runs:
        return buffers, np.zeros(0, dtype=np.int64)
    if not buffers:
        raise InvalidSourceError("aux_runs: the source's endpoint has no aux_regions")
    if len(source.aux_runs) > MAX_RUNS:
        raise InvalidSourceError(f"aux_runs: more than {MAX_RUNS}")
    slot_runs = runs_from_proto(source.aux_runs, "aux_runs")
    # Checked on the runs, before any expansion: a forged count must not size an allocation.
    slots = min(b.num_pages for b in buffers)
    if sum(r.count for r in slot_runs) > slots or max(r.first + r.count for r in slot_runs) > slots:
        raise InvalidSourceError(f"aux_runs: slots outside the source's {slots} aux slots")
    return buffers, runs.runs_to_pages(slot_runs)
