"""Prefix page keys: a SHA-256 chain over full pages of token ids.

key[0] = SHA-256(seed || tokens[0:P] as little-endian uint32)
key[i] = SHA-256(key[i-1] || tokens[i*P:(i+1)*P] as little-endian uint32)

The seed binds the chain to one KV contract and one tenant:
seed = SHA-256(b"xavier.v1/prefix" || contract_fingerprint || b"\\0" || cache_salt (utf-8)).

Like SGLang's HiCache key chain (per-page SHA-256 over little-endian uint32 token ids, each page's hash
seeded by its parent's), a key names a page *and its whole prefix*, so two prompts share a key only when
every earlier token matches. Unlike SGLang, whose chain starts from an empty parent or the request's
`extra_key`, the Xavier chain is always seeded by the layout fingerprint as well, so pages computed under
one model layout can never be looked up under another (I4) nor under another salt (I5). Only full pages get
keys: a partial last page is always recomputed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_SEED_TAG = b"xavier.v1/prefix"


def chain_seed(contract_fingerprint: bytes | str, cache_salt: str = "") -> bytes:
    """Returns the 32-byte seed of the key chain for one layout fingerprint and one tenant salt."""
    fp = contract_fingerprint.encode() if isinstance(contract_fingerprint, str) else contract_fingerprint
    return hashlib.sha256(_SEED_TAG + fp + b"\0" + cache_salt.encode("utf-8")).digest()


def page_keys(seed: bytes, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Returns one 32-byte key per *full* page of `token_ids`, each chained to the previous one."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    full = len(token_ids) // page_size
    if full == 0:
        return []
    data = np.asarray(token_ids[: full * page_size], dtype="<u4").tobytes()  # sliced as bytes: no view a page
    step = page_size * 4
    keys: list[bytes] = []
    prev = seed
    for at in range(0, full * step, step):
        prev = hashlib.sha256(prev + data[at : at + step]).digest()
        keys.append(prev)
    return keys
