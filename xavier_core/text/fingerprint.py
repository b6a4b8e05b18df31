"""The prompt fingerprint a room records: the router computes it, the directory compares it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def prompt_fingerprint(token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the token ids as little-endian uint32 (the room's prompt fingerprint)."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).digest()
