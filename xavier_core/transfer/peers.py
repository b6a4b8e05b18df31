"""The old path of `common.peers`, kept while `services/xavier_services/decode/servicer.py` imports
`peer_key` by it; new code imports from `xavier_core.transfer`."""

from __future__ import annotations

from xavier_core.transfer.common.peers import peer_key, split_peer_key

__all__ = ["peer_key", "split_peer_key"]
