"""Page checksums of a local pool: `local_page_checksums` is `page_checksum` (XXH3-128 over a page's
segments in order, what the store compares) of each page, whichever way it hashes a page."""

from __future__ import annotations

import numpy as np
import pytest

from xavier_core.pagestore import layout
from xavier_core.pagestore.layout import local_page_checksums, page_checksum
from xavier_core.transfer.common.buffers import KvBuffer


@pytest.mark.parametrize(
    ("segments", "segment_bytes"),
    # in place with the GIL held (long segments, or pages past 512 KiB), joined (short ones up to it)
    [(2, 96 << 10), (2, 1 << 20), (48, 4 << 10), (32, 48 << 10), (56, 16 << 10)],
)
def test_local_page_checksums_are_page_checksum_of_each_pages_segments(
    segments: int, segment_bytes: int
) -> None:
    rng = np.random.default_rng(segments)
    pages = 5
    arrays = [rng.integers(0, 256, pages * segment_bytes, dtype=np.uint8) for _ in range(segments)]
    buffers = [KvBuffer(a.ctypes.data, a.nbytes, segment_bytes, "cpu") for a in arrays]
    want = [
        page_checksum([a[p * segment_bytes : (p + 1) * segment_bytes].tobytes() for a in arrays])
        for p in range(pages)
    ]
    assert local_page_checksums(buffers, [4, 0, 2]) == [want[4], want[0], want[2]]
    arrays[1][2 * segment_bytes] ^= 1  # one flipped bit in one segment changes only that page's sum
    got = local_page_checksums(buffers, range(pages))
    assert [g == w for g, w in zip(got, want, strict=True)] == [True, True, False, True, True]


def test_the_in_place_hash_is_there() -> None:
    """The wheels this project installs export XXH3's streaming calls: the fast path is not skipped."""
    assert layout._held_xxh3() is not None
