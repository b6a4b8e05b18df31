"""Page runs and descriptor pairing: exact coverage, checked against a numpy gather."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.transfer import (
    InvalidPagesError,
    InvalidSourceError,
    KvBuffer,
    LayoutError,
    PageRun,
    SourceInfo,
    coalesce,
    descriptors,
    endpoint_proto,
    expand,
    pair_stretches,
)
from xavier_core.transfer.common import runs
from xavier_core.transfer.nixl.prepped import all_distinct, stretch_count


def test_coalesce_keeps_order_and_merges_consecutive_ids() -> None:
    assert coalesce([3, 4, 5, 9, 10, 2, 3, 7]) == [PageRun(3, 3), PageRun(9, 2), PageRun(2, 2), PageRun(7, 1)]
    assert coalesce([5, 4, 3]) == [PageRun(5, 1), PageRun(4, 1), PageRun(3, 1)]
    assert coalesce([]) == []
    assert expand([PageRun(3, 3), PageRun(0, 1)]) == [3, 4, 5, 0]


def test_bad_pages_are_rejected() -> None:
    with pytest.raises(InvalidPagesError):
        coalesce([1, -2])
    with pytest.raises(InvalidPagesError):
        PageRun(0, 0)
    with pytest.raises(InvalidPagesError, match="source has 2 pages, destination 1"):
        pair_stretches(np.array([1, 2]), np.array([3]))
    with pytest.raises(LayoutError):
        descriptors([0], [0, 1], [8], [1], [1])


def test_stretch_must_be_contiguous_on_both_sides() -> None:
    rows = pair_stretches(np.array([1, 2, 3, 4]), np.array([10, 11, 20, 21]))
    assert rows.tolist() == [[1, 10, 2], [3, 20, 2]]
    assert pair_stretches(np.array([1, 2]), np.array([5, 6]), "per_page").tolist() == [[1, 5, 1], [2, 6, 1]]


runs_cases = st.integers(1, 80).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 96), min_size=n, max_size=n),
        st.lists(st.integers(0, 96), min_size=n, max_size=n),
        st.booleans(),
    )
)


@settings(max_examples=300, deadline=None)
@given(runs_cases)
def test_short_page_lists_give_the_vectorised_answer(case: tuple[list[int], list[int], bool]) -> None:
    """Up to `runs.SMALL` pages, runs and stretches are found over lists: the same values, dtypes and
    shapes as the vectorised path gives (which longer lists take)."""
    src, dst, ascending = case
    if ascending:
        src, dst = sorted(set(src)), sorted(set(dst))
        dst = (dst * len(src))[: len(src)]
    a, b = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)

    def answers() -> list[object]:
        out: list[object] = [coalesce(a), runs.runs_to_pages(coalesce(a)), runs._breaks(a), all_distinct(a)]
        if a.size == b.size:
            out += [pair_stretches(a, b), runs._breaks(a, b), stretch_count(a, b)]
        return out

    short = answers()
    small = runs.SMALL
    runs.SMALL = 0
    try:
        vectorised = answers()
    finally:
        runs.SMALL = small
    for x, y in zip(short, vectorised, strict=True):
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape
            assert x.tolist() == y.tolist()
        else:
            assert x == y


def _copy(desc: np.ndarray, src: np.ndarray, dst: np.ndarray, src_base: int, dst_base: int) -> None:
    for s, d, n in desc.tolist():
        dst[d - dst_base : d - dst_base + n] = src[s - src_base : s - src_base + n]


pairs = st.integers(1, 40).flatmap(
    lambda n: st.tuples(
        st.permutations(range(48)).map(lambda p: list(p[:n])),
        st.permutations(range(48)).map(lambda p: list(p[:n])),
        st.lists(st.sampled_from([8, 24, 64]), min_size=1, max_size=3),
        st.sampled_from(["coalesced", "per_page"]),
    )
)


@settings(max_examples=150, deadline=None)
@given(pairs)
def test_descriptors_copy_exactly_the_paired_pages(case: tuple[list[int], list[int], list[int], str]) -> None:
    src_pages, dst_pages, bpps, mode = case
    # Pages of one flat byte space: buffer b occupies [offset_b, offset_b + 48 * bpp_b).
    offsets = np.cumsum([0, *(48 * b for b in bpps)])[:-1].tolist()
    src = np.random.default_rng(len(src_pages)).integers(0, 256, sum(48 * b for b in bpps), dtype=np.uint8)
    dst = np.zeros_like(src)
    base_s, base_d = 1 << 40, 1 << 41
    desc = descriptors(
        [base_s + o for o in offsets],
        [base_d + o for o in offsets],
        bpps,
        src_pages,
        dst_pages,
        mode,  # type: ignore[arg-type]
    )
    assert desc.dtype == np.uint64 and desc.shape[1] == 3
    assert int(desc[:, 2].sum()) == len(src_pages) * sum(bpps)
    _copy(desc.astype(np.int64), src, dst, base_s, base_d)
    for off, bpp in zip(offsets, bpps, strict=True):
        s_pages = src[off : off + 48 * bpp].reshape(48, bpp)
        d_pages = dst[off : off + 48 * bpp].reshape(48, bpp)
        assert np.array_equal(d_pages[dst_pages], s_pages[src_pages])  # reference gather
        untouched = sorted(set(range(48)) - set(dst_pages))
        assert not d_pages[untouched].any()
    if mode == "per_page":
        assert desc.shape[0] == len(src_pages) * len(bpps)
    else:
        assert desc.shape[0] == len(pair_stretches(np.array(src_pages), np.array(dst_pages))) * len(bpps)


def test_contiguous_pages_need_one_descriptor_per_buffer() -> None:
    desc = descriptors([0, 10_000], [50_000, 90_000], [16, 16], range(100), range(200, 300))
    assert desc.tolist() == [[0, 50_000 + 3200, 1600], [10_000, 90_000 + 3200, 1600]]


def _info() -> SourceInfo:
    return SourceInfo("prefill-a", b"md", (KvBuffer(4096, 8192, 1024, "cuda:1"),), (PageRun(3, 2),), "tok")


def _wire(info: SourceInfo) -> tuple[dpb.SourceDescriptor, types_pb2.TransferEndpoint]:
    endpoint = endpoint_proto(info.agent_name, info.metadata, info.buffers)
    return info.to_proto("fp"), endpoint


def test_source_info_round_trips_the_descriptor() -> None:
    info = _info()
    desc, endpoint = _wire(info)
    desc = dpb.SourceDescriptor.FromString(desc.SerializeToString())
    assert desc.num_pages == 2 and desc.contract_fingerprint == "fp" and desc.read_token == "tok"
    assert endpoint.kind == types_pb2.TRANSPORT_KIND_NIXL
    assert [(r.base_address, r.length, r.bytes_per_page, r.device) for r in endpoint.regions] == [
        (4096, 8192, 1024, "cuda:1")
    ]
    assert SourceInfo.from_proto(desc, endpoint) == info
    assert info.page_ids().tolist() == [3, 4]


Spoil = Callable[[dpb.SourceDescriptor, types_pb2.TransferEndpoint], None]


def _bad_name(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    e.agent_name = "n" * 300


def _no_metadata(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    e.agent_metadata = b""


def _empty_run(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    d.page_runs.add(first_page=1, count=0)


def _no_runs(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    del d.page_runs[:]


def _no_regions(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    del e.regions[:]


def _no_device(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    e.regions[0].device = ""


def _colon_token(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    d.read_token = "a:b"


def _long_token(d: dpb.SourceDescriptor, e: types_pb2.TransferEndpoint) -> None:
    d.read_token = "t" * 200


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (_bad_name, "endpoint.agent_name"),
        (_no_metadata, "endpoint.agent_metadata: empty"),
        (_empty_run, "page_runs"),
        (_no_runs, "page_runs: empty"),
        (_no_regions, "endpoint.regions: empty"),
        (_no_device, r"endpoint.regions\[0\].device"),
        (_colon_token, "read_token"),
        (_long_token, "read_token"),
    ],
)
def test_source_info_rejects_bad_descriptors(spoil: Spoil, match: str) -> None:
    desc, endpoint = _wire(_info())
    spoil(desc, endpoint)
    with pytest.raises(InvalidSourceError, match=match):
        SourceInfo.from_proto(desc, endpoint)
