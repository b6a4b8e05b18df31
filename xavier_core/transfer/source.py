"""What a source publishes so a reader can pull its pages: `SourceInfo` and its plain-field form."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from xavier_core.engine.api import KvBuffer
from xavier_core.transfer.errors import InvalidPagesError, InvalidSourceError
from xavier_core.transfer.runs import PageRun, runs_to_pages

# Limits on network input: NIXL metadata is ~0.5 KB + 44 B per region.
MAX_METADATA_BYTES = 1 << 20
MAX_BUFFERS = 4096
MAX_RUNS = 1 << 20
MAX_AUX_BYTES = 64 << 10
MAX_NAME_CHARS = 256
MAX_TOKEN_CHARS = 128


@dataclass(frozen=True)
class SourceInfo:
    """A published source: the NIXL endpoint, its KV buffers, the pages (as runs) and the aux bytes."""

    agent_name: str
    metadata: bytes
    buffers: tuple[KvBuffer, ...]
    runs: tuple[PageRun, ...]
    aux: bytes = b""
    token: str = ""  # the source's read token: the reader's notifications carry it

    @property
    def num_pages(self) -> int:
        return sum(r.count for r in self.runs)

    def page_ids(self) -> npt.NDArray[np.int64]:
        return runs_to_pages(self.runs)

    def to_fields(self) -> dict[str, Any]:
        """Plain fields (str, bytes, ints, lists of tuples) for the services' protobuf mapping."""
        return {
            "agent_name": self.agent_name,
            "metadata": self.metadata,
            "regions": [(b.addr, b.nbytes, b.bytes_per_page, b.device) for b in self.buffers],
            "runs": [(r.first, r.count) for r in self.runs],
            "aux": self.aux,
            "token": self.token,
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> SourceInfo:
        """Validates plain fields from the network; `InvalidSourceError` names the bad field."""
        name = _typed(fields, "agent_name", str)
        metadata = _typed(fields, "metadata", bytes)
        aux = _typed(fields, "aux", bytes)
        token = fields.get("token", "")
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or ":" in token:
            raise InvalidSourceError("token: expected a short string without ':'")
        regions = _seq(fields, "regions", MAX_BUFFERS)
        run_rows = _seq(fields, "runs", MAX_RUNS)
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidSourceError("agent_name: empty or too long")
        if not metadata or len(metadata) > MAX_METADATA_BYTES:
            raise InvalidSourceError("metadata: empty or larger than the limit")
        if len(aux) > MAX_AUX_BYTES:
            raise InvalidSourceError("aux: larger than the limit")
        try:
            buffers = tuple(
                KvBuffer(_int(addr), _int(nbytes), _int(bpp), str(dev)) for addr, nbytes, bpp, dev in regions
            )
            runs = tuple(PageRun(_int(first), _int(count)) for first, count in run_rows)
        except (TypeError, ValueError, InvalidPagesError) as exc:
            raise InvalidSourceError(f"regions/runs: malformed entry ({exc})") from exc
        if not buffers:
            raise InvalidSourceError("regions: empty")
        return cls(name, metadata, buffers, runs, aux, token)


def _typed(fields: Mapping[str, Any], key: str, kind: type) -> Any:
    value = fields.get(key)
    if not isinstance(value, kind):
        raise InvalidSourceError(f"{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _seq(fields: Mapping[str, Any], key: str, limit: int) -> Sequence[Any]:
    value = fields.get(key)
    if not isinstance(value, list | tuple):
        raise InvalidSourceError(f"{key}: expected a list")
    if len(value) > limit:
        raise InvalidSourceError(f"{key}: {len(value)} entries exceed the limit of {limit}")
    return value


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return int(value)
