"""Page store configuration (``[pagestore]`` in TOML; ``XAVIER_PAGESTORE__<KEY>`` in the environment)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xavier_core.runtime.config import ServiceConfig

__all__ = ["PageStoreConfig", "PageStoreSettings"]

MiB = 1 << 20


class PageStoreSettings(BaseModel):
    """Arena size, chunking, leases and per-call limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arena_bytes: int = Field(default=256 * MiB, ge=64 * 1024, le=1 << 42)
    """DRAM arena registered with NIXL once; the byte bound of stored and reserved pages."""
    chunk_bytes: int = Field(default=16 * MiB, ge=4096, le=1 << 32)
    """Arena chunk given to one namespace at a time; a page may not exceed it, runs never cross it."""
    lease_seconds: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Default read and write lease when a call asks for none."""
    max_lease_seconds: float = Field(default=60.0, gt=0.0, le=86400.0)
    """Longest lease a call may ask for; longer requests are cut to it."""
    max_keys_per_call: int = Field(default=1024, ge=1, le=65536)
    """Keys one Exists, Get or Put call accepts (clients split longer chains into calls)."""
    max_segments: int = Field(default=4096, ge=1, le=65536)
    """Segments (KV buffers) of one page."""
    max_namespaces: int = Field(default=1024, ge=1, le=1_000_000)
    """Namespaces the store tracks before CAPACITY_EXHAUSTED."""
    max_leases: int = Field(default=65536, ge=1, le=10_000_000)
    """Live read and write leases before CAPACITY_EXHAUSTED."""
    sweep_interval_seconds: float = Field(default=0.1, gt=0.0, le=60.0)
    """How often expired leases are ended."""
    idempotency_entries: int = Field(default=65536, ge=16, le=10_000_000)
    """Recent request ids remembered for idempotent retries."""
    progress_interval_seconds: float = Field(default=0.0005, gt=0.0, le=1.0)
    """NIXL progress polling interval while any lease is live (the arena is the passive side)."""

    @model_validator(mode="after")
    def _check(self) -> PageStoreSettings:
        if self.chunk_bytes > self.arena_bytes:
            raise ValueError(f"chunk_bytes ({self.chunk_bytes}) exceeds arena_bytes ({self.arena_bytes})")
        if self.lease_seconds > self.max_lease_seconds:
            raise ValueError("lease_seconds must not exceed max_lease_seconds")
        return self


class PageStoreConfig(ServiceConfig):
    """The page store process: common service settings plus ``[pagestore]``."""

    pagestore: PageStoreSettings = PageStoreSettings()
