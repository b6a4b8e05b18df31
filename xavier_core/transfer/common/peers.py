"""Peer keys: one epoch of one peer, the unit the NIXL agent caches remote metadata under."""

from __future__ import annotations


def peer_key(peer_id: str, epoch: int) -> str:
    """The key of one epoch of a peer; `NixlAgent.add_peer` drops older epochs of the same id."""
    return f"{peer_id}@{epoch}"


def split_peer_key(key: str) -> tuple[str, int] | None:
    """(peer id, epoch) of a key made by `peer_key`; None for any other string (an ad-hoc key)."""
    peer_id, sep, epoch = key.rpartition("@")
    if not sep or not peer_id or not epoch.isdigit():
        return None
    return peer_id, int(epoch)
