"""Typed errors of the transfer layer; the services map them to gRPC statuses."""

from __future__ import annotations


class TransferError(Exception):
    """Base class of transfer-layer errors."""


class InvalidPagesError(TransferError, ValueError):
    """Page ids out of range, duplicated destinations, or source and destination counts that differ."""


class LayoutError(TransferError):
    """The two sides' KV buffers do not line up (buffer count or bytes per page differ)."""


class PeerError(TransferError):
    """The peer is unknown, was dropped, or disconnected (its process died)."""


class StaleEpochError(PeerError):
    """Metadata of an older epoch arrived after a newer epoch of the same peer id was added."""


class InvalidSourceError(TransferError, ValueError):
    """A source description from the network is malformed or exceeds a size limit."""


class TransferInFlightError(TransferError):
    """The operation needs the read to have ended, and it may still be touching pages."""
