"""Page checksums of a local pool: `local_page_checksums` is `page_checksum` (XXH3-128 over a page's
segments in order, what the store compares) of each page, whichever way it hashes a page: the built loop
without the GIL (`native`), or page by page where that cannot be built."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from xavier_core.pagestore import layout, native
from xavier_core.pagestore.layout import local_page_checksums, page_checksum
from xavier_core.transfer.common.buffers import KvBuffer


@pytest.fixture(params=["native", "page_by_page"])
def hashing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "page_by_page":
        monkeypatch.setattr(native, "native_hash", lambda: None)
    return str(request.param)


@pytest.mark.parametrize(
    ("segments", "segment_bytes"),
    # in place with the GIL held (long segments, or pages past 512 KiB), joined (short ones up to it)
    [(2, 96 << 10), (2, 1 << 20), (48, 4 << 10), (32, 48 << 10), (56, 16 << 10)],
)
def test_local_page_checksums_are_page_checksum_of_each_pages_segments(
    hashing: str, segments: int, segment_bytes: int
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


def test_row_checksums_are_page_checksum_of_each_row(hashing: str) -> None:
    rows = np.random.default_rng(7).integers(0, 256, (40, 3 << 18), dtype=np.uint8)  # 30 MiB: threads
    want = [page_checksum([r.tobytes()]) for r in rows]
    assert layout.page_row_checksums(rows) == want
    rows[17, 5] ^= 0x80
    assert [a == b for a, b in zip(layout.page_row_checksums(rows), want, strict=True)] == [
        i != 17 for i in range(40)
    ]


def test_the_native_loop_builds_here() -> None:
    """Every machine the project runs on has a C compiler (CI's and the GPU hosts'): the loop without
    the GIL is not silently skipped."""
    assert native.available()


def test_a_failed_build_falls_back_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "_cache_dirs", lambda: [tmp_path])
    monkeypatch.setenv("CC", "false")
    native.native_hash.cache_clear()
    try:
        assert native.native_hash() is None
        assert "native page checksums unavailable" in caplog.text
        assert list(tmp_path.iterdir()) == []  # no partial file left behind
        arrays = [np.arange(4 * 4096, dtype=np.uint8) for _ in range(3)]
        buffers = [KvBuffer(a.ctypes.data, a.nbytes, 4096, "cpu") for a in arrays]
        assert local_page_checksums(buffers, [1]) == [page_checksum([a[4096:8192].tobytes() for a in arrays])]
    finally:
        native.native_hash.cache_clear()


def test_a_library_others_could_write_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, own = tmp_path / "shared", tmp_path / "own"
    shared.mkdir()
    shared.chmod(0o777)  # as a shared temporary directory is
    name = f"pagehash-{hashlib.sha256(native._SOURCE.read_bytes()).hexdigest()[:16]}.so"
    (shared / name).write_bytes(b"planted")
    monkeypatch.setattr(native, "_cache_dirs", lambda: [shared, own])
    built = native._build()
    assert built == own / name
    assert (shared / name).read_bytes() == b"planted"
    assert built.stat().st_mode & 0o777 == 0o700
