"""What a source publishes so a reader can pull its pages: `SourceInfo`, and its wire form, the
contract's `SourceDescriptor` (validated here, since it arrives from the network)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError, InvalidSourceError
from xavier_core.transfer.common.runs import PageRun, coalesce, runs_to_pages
from xavier_core.transfer.common.slab_layout import SlabLayout

# Limits on network input: NIXL metadata is ~0.5 KB + 44 B per region.
MAX_METADATA_BYTES = 1 << 20
MAX_BUFFERS = 4096
MAX_RUNS = 1 << 20
MAX_NAME_CHARS = 256
MAX_TOKEN_CHARS = 128
MAX_DEVICE_CHARS = 32


@dataclass(frozen=True)
class SourceInfo:
    """A published source: the NIXL endpoint, its KV buffers and the pages (as runs)."""

    agent_name: str
    metadata: bytes
    buffers: tuple[KvBuffer, ...]
    runs: tuple[PageRun, ...]
    token: str = ""  # the source's read token: the reader's notifications carry it
    # Staged transport (see `staged.slab`): the source's slab chunks holding the pages, and its slab.
    staging_runs: tuple[PageRun, ...] = ()
    slab: KvBuffer | None = None

    @property
    def num_pages(self) -> int:
        return sum(r.count for r in self.runs)

    def page_ids(self) -> npt.NDArray[np.int64]:
        """The pages the runs cover, in order; computed once per source (a pull asks twice: to pair
        them with the reader's pages and to post the READ), read-only since it is shared."""
        pages: npt.NDArray[np.int64] | None = self.__dict__.get("_page_ids")
        if pages is None:
            pages = runs_to_pages(self.runs)
            pages.flags.writeable = False
            object.__setattr__(self, "_page_ids", pages)
        return pages

    def staging_chunks(self) -> npt.NDArray[np.int64]:
        return runs_to_pages(self.staging_runs)

    def staging_slab(self) -> tuple[KvBuffer, SlabLayout]:
        """The source's slab and how it is cut; `InvalidSourceError` when it has none or a bad one."""
        if self.slab is None:
            raise InvalidSourceError("endpoint.staging_slab: absent, but the source staged the room")
        return self.slab, SlabLayout.of_peer(self.buffers, self.slab)

    def to_proto(self, fingerprint: str = "") -> dpb.SourceDescriptor:
        """The descriptor a source hands to the directory (PublishSource). It names pages, not memory:
        readers get the source's endpoint once per peer epoch, apart from any one room."""
        return dpb.SourceDescriptor(
            page_runs=[types_pb2.PageRun(first_page=r.first, count=r.count) for r in self.runs],
            num_pages=self.num_pages,
            contract_fingerprint=fingerprint,
            read_token=self.token,
            staging_runs=[types_pb2.PageRun(first_page=r.first, count=r.count) for r in self.staging_runs],
        )

    @classmethod
    def from_proto(cls, source: dpb.SourceDescriptor, endpoint: types_pb2.TransferEndpoint) -> SourceInfo:
        """Validates a descriptor and its source's endpoint from the network; `InvalidSourceError` names
        the bad field."""
        ep = endpoint
        _limit(len(ep.agent_name), MAX_NAME_CHARS, "endpoint.agent_name")
        _limit(len(ep.agent_metadata), MAX_METADATA_BYTES, "endpoint.agent_metadata")
        _limit(len(ep.regions), MAX_BUFFERS, "endpoint.regions")
        _limit(len(source.page_runs), MAX_RUNS, "page_runs")
        token = source.read_token
        if len(token) > MAX_TOKEN_CHARS or ":" in token:
            raise InvalidSourceError("read_token: expected a short string without ':'")
        buffers = buffers_from_regions(ep.regions, "endpoint.regions")
        runs = runs_from_proto(source.page_runs, "page_runs")
        info = cls(ep.agent_name, ep.agent_metadata, buffers, runs, token)
        return info if not source.staging_runs else _with_staging(info, source, ep)


def _with_staging(
    info: SourceInfo, source: dpb.SourceDescriptor, ep: types_pb2.TransferEndpoint
) -> SourceInfo:
    """`info` with its staging chunks, checked against the source's slab (network input)."""
    _limit(len(source.staging_runs), MAX_RUNS, "staging_runs")
    if not ep.HasField("staging_slab"):
        raise InvalidSourceError("endpoint.staging_slab: absent")
    (slab,) = buffers_from_regions([ep.staging_slab], "endpoint.staging_slab")
    staging = runs_from_proto(source.staging_runs, "staging_runs")
    info = dataclasses.replace(info, staging_runs=staging, slab=slab)
    _, layout = info.staging_slab()
    # Checked on the runs, before any expansion: a forged count must not size an allocation.
    count = sum(r.count for r in staging)
    last = max(r.first + r.count - 1 for r in staging)
    if count != layout.chunks_for(info.num_pages) or last >= layout.num_chunks:
        raise InvalidSourceError(
            f"staging_runs: {count} chunks (up to id {last}) do not hold "
            f"{info.num_pages} pages in a slab of {layout.num_chunks} chunks"
        )
    return info


def endpoint_proto(
    agent_name: str,
    metadata: bytes,
    buffers: tuple[KvBuffer, ...] | list[KvBuffer],
    host_id: str = "",
    slab: KvBuffer | None = None,
) -> types_pb2.TransferEndpoint:
    """A NIXL agent's endpoint message: what a peer needs to load it and address its buffers (and its
    staging slab, when it has one)."""
    endpoint = types_pb2.TransferEndpoint(
        kind=types_pb2.TRANSPORT_KIND_NIXL,
        agent_name=agent_name,
        agent_metadata=metadata,
        regions=regions_proto(buffers),
        host_id=host_id,
    )
    if slab is not None:
        endpoint.staging_slab.CopyFrom(regions_proto([slab])[0])
    return endpoint


def regions_proto(buffers: Iterable[KvBuffer]) -> list[types_pb2.MemoryRegion]:
    """The wire form of buffers: an endpoint's `regions` (or its `aux_regions`)."""
    return [
        types_pb2.MemoryRegion(
            base_address=b.addr, length=b.nbytes, device=b.device, bytes_per_page=b.bytes_per_page
        )
        for b in buffers
    ]


def buffers_from_regions(regions: Sequence[types_pb2.MemoryRegion], field: str) -> tuple[KvBuffer, ...]:
    """Buffers of an endpoint's `regions` (or `aux_regions`) from the network; `InvalidSourceError`
    names `field`."""
    for i, r in enumerate(regions):
        if not r.device or len(r.device) > MAX_DEVICE_CHARS:
            raise InvalidSourceError(f"{field}[{i}].device: empty or too long")
    return tuple(KvBuffer(r.base_address, r.length, r.bytes_per_page, r.device) for r in regions)


def page_runs_proto(page_ids: Sequence[int]) -> list[types_pb2.PageRun]:
    """Page ids as the contract's runs, consecutive ids merged, order kept."""
    return [types_pb2.PageRun(first_page=r.first, count=r.count) for r in coalesce(page_ids)]


def runs_from_proto(runs: Iterable[types_pb2.PageRun], field: str) -> tuple[PageRun, ...]:
    """Page runs (or slot runs) of a descriptor from the network; `InvalidSourceError` names `field`."""
    try:
        return tuple(PageRun(r.first_page, r.count) for r in runs)
    except InvalidPagesError as exc:
        raise InvalidSourceError(f"{field}: malformed entry ({exc})") from exc


def _limit(size: int, limit: int, field: str) -> None:
    """Empty or over the limit: both are malformed for every field checked with this."""
    if size == 0:
        raise InvalidSourceError(f"{field}: empty")
    if size > limit:
        raise InvalidSourceError(f"{field}: {size} exceeds the limit of {limit}")
