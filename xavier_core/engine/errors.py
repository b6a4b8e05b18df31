"""Errors of the reference engine beyond the engine-neutral ones in `api`."""

from __future__ import annotations

from xavier_core.engine.api import EngineError


class CheckpointError(EngineError):
    """A checkpoint directory is missing, corrupt or describes a model the engine does not serve."""


class RequestAbortedError(EngineError):
    """A prefill-only request was aborted before its first token was sampled."""


class EngineClosedError(EngineError):
    """The engine is shutting down or closed and accepts no more work."""
