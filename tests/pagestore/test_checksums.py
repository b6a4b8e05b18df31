"""Page checksums of a local pool: `local_page_checksums` is `page_checksum` (XXH3-128 over a page's
segments in order, what the store compares) of each page, whichever way it hashes a page: the built loop
without the GIL (`native`), or page by page where that cannot be built."""

from __future__ import annotations

import errno
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


def _pages(seed: int, pages: int, segments: int, segment_bytes: int) -> tuple[list[np.ndarray], list[bytes]]:
    """`segments` buffers of `pages` random pages each, and each page's `page_checksum`."""
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, pages * segment_bytes, dtype=np.uint8) for _ in range(segments)]
    want = [
        page_checksum([a[p * segment_bytes : (p + 1) * segment_bytes].tobytes() for a in arrays])
        for p in range(pages)
    ]
    return arrays, want


def _buffers(arrays: list[np.ndarray], segment_bytes: int) -> list[KvBuffer]:
    return [KvBuffer(a.ctypes.data, a.nbytes, segment_bytes, "cpu") for a in arrays]


def _hash_ranges(arrays: list[np.ndarray], segment_bytes: int) -> np.ndarray:
    return layout.page_ranges(_buffers(arrays, segment_bytes), range(arrays[0].nbytes // segment_bytes))


def _read_ranges(src: list[np.ndarray], dst: list[np.ndarray], segment_bytes: int) -> np.ndarray:
    """(pages, segments, 3) words: each segment read from `src`'s page into the same page of `dst`."""
    frm, to = _hash_ranges(src, segment_bytes), _hash_ranges(dst, segment_bytes)
    return np.stack([frm[:, :, 0], to[:, :, 0], frm[:, :, 1]], axis=2)


@pytest.mark.parametrize(
    ("segments", "segment_bytes"),
    # in place with the GIL held (long segments, or pages past 512 KiB), joined (short ones up to it)
    [(2, 96 << 10), (2, 1 << 20), (48, 4 << 10), (32, 48 << 10), (56, 16 << 10)],
)
def test_local_page_checksums_are_page_checksum_of_each_pages_segments(
    hashing: str, segments: int, segment_bytes: int
) -> None:
    pages = 5
    arrays, want = _pages(segments, pages, segments, segment_bytes)
    buffers = _buffers(arrays, segment_bytes)
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


def test_calls_at_once_from_many_threads_share_the_loops_helpers() -> None:
    """The loop's helper threads outlive a call and serve every caller: calls made at once from eight
    Python threads, each wanting more helpers than exist, each get their own pages' checksums, a read
    of an unmapped address among them fails alone, and calls after it still run on all their threads."""
    import os
    import threading

    nh = native.native_hash()
    assert nh is not None
    segment_bytes = 4096
    errors: list[BaseException] = []
    finished: set[int] = set()
    faults: list[int | None] = []
    jobs = [_pages(seed, 24, 3, segment_bytes) for seed in range(8)]

    def work(i: int) -> None:
        arrays, want = jobs[i]
        try:
            for n in range(20):
                threads = 1 + (i + n) % 12
                if i % 2:
                    assert nh.checksums(_hash_ranges(arrays, segment_bytes), threads) == want
                else:
                    dst = [np.zeros_like(a) for a in arrays]
                    ranges = _read_ranges(arrays, dst, segment_bytes)
                    assert nh.read_checksums(os.getpid(), ranges, threads) == want
                    assert all(np.array_equal(a, b) for a, b in zip(arrays, dst, strict=True))
                    if i == 4 and n == 10:
                        ranges[7, 1, 0] = 8  # the first page of memory: never mapped
                        with pytest.raises(OSError) as err:
                            nh.read_checksums(os.getpid(), ranges, threads)
                        faults.append(err.value.errno)
            finished.add(i)
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert finished == set(range(8))
    assert len(faults) == 1 and faults[0] in (errno.EFAULT, errno.EIO)  # EIO: the read stopped short at it
    arrays, want = jobs[0]
    assert nh.checksums(_hash_ranges(arrays, segment_bytes), 64) == want


def test_a_forked_child_starts_its_own_helpers() -> None:
    """A process forked after the loop's helpers started has none of them (fork copies the caller's
    thread alone): its calls start their own and return the right checksums rather than waiting on
    helpers that are not there."""
    import os
    import time

    nh = native.native_hash()
    assert nh is not None
    arrays, want = _pages(3, 32, 2, 8192)
    ranges = _hash_ranges(arrays, 8192)
    assert nh.checksums(ranges, 6) == want  # the parent's helpers exist now
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only with the right checksums
        ok = nh.checksums(ranges, 6) == want and nh.checksums(ranges, 6) == want
        os._exit(0 if ok else 3)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's call never returned")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert nh.checksums(ranges, 6) == want
