"""Content fingerprints of model files, cached on disk by (path, size, mtime_ns).

Hashing a multi-GB checkpoint takes seconds to minutes; a restart must not pay that again. Each file's
SHA-256 is stored in its own small JSON entry named by the digest of the cache key (resolved path, size,
mtime_ns), so concurrent processes never read-modify-write a shared index: writers race only on an atomic
rename of identical content. A file whose size or mtime changed has another key and is hashed again; stale
entries are harmless (a few hundred bytes each).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FileHashCache", "default_cache_dir", "fingerprint_files", "sha256_file"]

_CHUNK = 4 * 1024 * 1024
_ENTRY_VERSION = 1


def default_cache_dir() -> Path:
    """``$XAVIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/xavier``, else ``~/.cache/xavier``."""
    explicit = os.environ.get("XAVIER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "xavier"


def sha256_file(path: Path) -> str:
    """Streams ``path`` through SHA-256 and returns the hex digest (the one place file content is read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class FileHashCache:
    """SHA-256 of files, remembered under ``<cache_dir>/file-hashes/`` keyed by (path, size, mtime_ns).

    ``directory=None`` disables the disk cache (every call hashes). ``hits`` and ``misses`` count lookups
    since construction; a miss is a full read of the file.
    """

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory / "file-hashes" if directory is not None else None
        self.hits = 0
        self.misses = 0

    @classmethod
    def default(cls) -> FileHashCache:
        """A cache under :func:`default_cache_dir`."""
        return cls(default_cache_dir())

    def _entry(self, key: str) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def digest(self, path: Path) -> str:
        """Hex SHA-256 of ``path``'s content, from the cache when size and mtime_ns are unchanged."""
        resolved = path.resolve()
        st = resolved.stat()
        key = f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}"
        entry = self._entry(key)
        if entry is not None:
            cached = _read_entry(entry, key)
            if cached is not None:
                self.hits += 1
                return cached
        self.misses += 1
        value = sha256_file(resolved)
        if entry is not None:
            _write_entry(entry, key, value)
        return value


def _read_entry(entry: Path, key: str) -> str | None:
    try:
        data = json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("v") != _ENTRY_VERSION or data.get("key") != key:
        return None
    value = data.get("sha256")
    if not isinstance(value, str) or len(value) != 64:
        return None
    return value


def _write_entry(entry: Path, key: str, value: str) -> None:
    # A cache that cannot be written (read-only home under systemd hardening) only costs a re-hash.
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"v": _ENTRY_VERSION, "key": key, "sha256": value}), encoding="utf-8")
        os.replace(tmp, entry)
    except OSError:
        return


def fingerprint_files(root: Path, files: Iterable[Path], cache: FileHashCache) -> str:
    """Hex SHA-256 over the sorted (name relative to ``root``, content digest) pairs of ``files``.

    File names are part of the fingerprint, so a renamed shard changes it; the order files were found in
    does not.
    """
    digest = hashlib.sha256(b"xavier.v1/files\n")
    for rel, path in sorted((p.relative_to(root).as_posix(), p) for p in files):
        digest.update(f"{rel}\0{cache.digest(path)}\n".encode())
    return digest.hexdigest()
