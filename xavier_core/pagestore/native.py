"""Page checksums of many pages in one call without the GIL: `pagehash.c`, built on first use.

Inside a process whose other threads run Python without pause (SGLang's scheduler beside its HiCache
thread), every return of a hashing thread from C waits for the GIL, up to a switch interval, and the
per-page or per-segment calls of `layout` pay that wait hundreds of times a get: 500 pages of
Qwen2.5-7B's shape (two 458 KiB segments each) took 228-298 ms to check inside SGLang on an H100 host,
where the same bytes hash in under 10 ms on a quiet one. `pagehash.c` loops over the pages in C and is
called through `ctypes.CDLL` (which releases the GIL for the call), its pages cut over threads of its
own (started as calls first need them, then kept between calls), so a whole get costs one hand-off:
spread over a Python thread pool instead, every worker's start and end waited for the GIL too, and beside
two busy threads that was slower than hashing page by page with the GIL held (500 pages of 917 KiB on an
H100 host: 219 vs 179 ms,
`docs/results/page-checksum-methods-h100-pool-pagefirst.json`).

The C file holds only the loop: XXH3-128's streaming calls are passed in from the library the `xxhash`
module is built on, so the checksums are `layout.page_checksum`'s by construction. It is compiled with the
system's C compiler (`$CC`, else `cc`) into `$XDG_CACHE_HOME/xavier` (else `~/.cache/xavier`, else the
temporary directory), once per source version, and loaded only from a folder and file this user owns and
no one else can write; where that fails, or `XAVIER_NATIVE_PAGEHASH=0` is set,
`available()` is False and `layout` hashes page by page as before (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["NativeHash", "available", "native_hash"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("pagehash.c")
_ENV = "XAVIER_NATIVE_PAGEHASH"
_COMPILE_TIMEOUT_S = 60.0
_MAX_THREADS = 64
"""The loop's own limit (`MAX_THREADS` in pagehash.c)."""


@dataclass(frozen=True)
class NativeHash:
    """The built loop and XXH3's streaming calls, as addresses it takes."""

    hash_pages: Any
    read_hash_pages: Any
    create: Any
    free: Any
    reset: int
    update: int
    digest: int

    def checksums(self, ranges: npt.NDArray[np.uint64], threads: int = 1) -> list[bytes]:
        """`layout.page_checksum` of each page of `ranges`, a C-contiguous (pages, segments, 2) array of
        (address, length) words, in one call made without the GIL, its pages cut over `threads` threads
        of the loop's own (at most 64)."""
        return self._run(self.hash_pages, (), ranges, threads)

    def read_checksums(self, pid: int, ranges: npt.NDArray[np.uint64], threads: int = 1) -> list[bytes]:
        """Reads each page of `ranges`, a C-contiguous (pages, segments, 3) array of (address in process
        `pid`, local address, length) words, out of that process's memory (`process_vm_readv`, one call a
        small group of pages, a segment's ranges of consecutive slots joined) and returns the
        `layout.page_checksum` of each as it landed, hashed right after its read while in cache; one call
        without the GIL, over `threads` threads of the loop's own. Raises `OSError` (the kernel's errno;
        EIO: a short read) when a read failed: the local pages then hold unspecified bytes."""
        return self._run(self.read_hash_pages, (pid,), ranges, threads)

    def read_pages(self, pid: int, ranges: npt.NDArray[np.uint64], threads: int = 1) -> None:
        """`read_checksums` without the checksums: the pages read alone, by the same loop (what checking
        them as they land adds is told against this). Raises `OSError` as it does."""
        pages, segments, _ = ranges.shape
        threads = max(1, min(threads, _MAX_THREADS, pages))
        states = (ctypes.c_void_p * threads)()
        data = ranges.ctypes.data
        rc = self.read_hash_pages(pid, None, None, None, states, threads, data, pages, segments, None)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))

    def _run(
        self, fn: Any, head: tuple[int, ...], ranges: npt.NDArray[np.uint64], threads: int
    ) -> list[bytes]:
        pages, segments, _ = ranges.shape
        threads = max(1, min(threads, _MAX_THREADS, pages))
        out = ctypes.create_string_buffer(16 * pages)
        states = (ctypes.c_void_p * threads)()
        try:
            for i in range(threads):
                states[i] = self.create()
                if not states[i]:
                    raise MemoryError("XXH3_createState failed")
            rc = fn(*head, self.reset, self.update, self.digest, states, threads, ranges.ctypes.data, pages,
                    segments, out)  # fmt: skip
        finally:
            for state in states:
                if state:
                    self.free(state)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        if rc != 0:
            raise RuntimeError(f"XXH3 failed with status {rc}")
        raw = out.raw
        return [raw[16 * i : 16 * (i + 1)] for i in range(pages)]


def available() -> bool:
    return native_hash() is not None


@functools.cache
def native_hash() -> NativeHash | None:
    """The built loop, or None where it cannot be had (see the module docstring)."""
    if os.environ.get(_ENV, "1") == "0":
        log.info("native page checksums off (%s=0)", _ENV)
        return None
    try:
        xxh = ctypes.CDLL(str(importlib.import_module("xxhash._xxhash").__file__))
        create, free = xxh.XXH3_createState, xxh.XXH3_freeState
        calls = [ctypes.cast(getattr(xxh, n), ctypes.c_void_p).value for n in _STREAMING]
        lib = ctypes.CDLL(str(_build()))
        hash_pages, read_hash_pages = lib.xavier_hash_pages, lib.xavier_read_hash_pages
    except (ImportError, OSError, AttributeError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("native page checksums unavailable, hashing page by page: %s", exc)
        return None
    create.restype = ctypes.c_void_p
    free.argtypes = [ctypes.c_void_p]
    # (reset, update, digest, states, threads, ranges, pages, segments, out), after the pid for a read
    loop_args: list[Any] = [
        *(ctypes.c_void_p,) * 3,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_char_p,
    ]
    hash_pages.restype = read_hash_pages.restype = ctypes.c_int
    hash_pages.argtypes = loop_args
    read_hash_pages.argtypes = [ctypes.c_int, *loop_args]
    reset, update, digest = (int(c or 0) for c in calls)
    return NativeHash(hash_pages, read_hash_pages, create, free, reset, update, digest)


_STREAMING = ("XXH3_128bits_reset", "XXH3_128bits_update", "XXH3_128bits_digest")


def _build() -> Path:
    """The compiled loop for this source, compiled now if no earlier process did (written under a
    temporary name and renamed into place, so processes building at once never load a partial file)."""
    source = _SOURCE.read_bytes()
    name = f"pagehash-{hashlib.sha256(source).hexdigest()[:16]}.so"
    for folder in _cache_dirs():
        lib = folder / name
        if lib.exists() and _private(folder) and _private(lib):
            return lib
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler ($CC, cc or gcc) on PATH")
    errors = []
    for folder in _cache_dirs():
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(folder):
                errors.append(f"{folder}: not this user's alone")
                continue
            fd, tmp = tempfile.mkstemp(prefix=name + ".", dir=folder)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        try:
            subprocess.run(
                [compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", tmp, str(_SOURCE)],
                check=True,
                capture_output=True,
                timeout=_COMPILE_TIMEOUT_S,
            )
            os.chmod(tmp, 0o700)
            os.replace(tmp, folder / name)
        except subprocess.CalledProcessError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise RuntimeError(f"{compiler} failed: {exc.stderr.decode(errors='replace')[-400:]}") from exc
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        log.info("built native page checksums: %s", folder / name)
        return folder / name
    raise RuntimeError("no writable folder for the built checksum loop: " + "; ".join(errors))


def _private(path: Path) -> bool:
    """Owned by this user and writable by no one else: a library anyone else could have put or changed
    there (a shared temporary directory) is never loaded."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cache_dirs() -> list[Path]:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = [Path(xdg)] if xdg else []
    try:
        base.append(Path.home() / ".cache")
    except RuntimeError:
        pass
    return [p / "xavier" for p in base] + [Path(tempfile.gettempdir()) / "xavier-cache"]
