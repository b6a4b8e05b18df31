"""How a request's cache salt reaches the hosted SGLang: the `/generate` field its release honours, or a
refusal. The release is read once from SGLang's `GET /server_info` (`version`) when the service starts.

- 0.5.23 on: `cache_salt`. It keys the radix cache (`RadixKey.cache_salt`) and seeds HiCache's storage
  key chain (`storage_namespace_seed(extra_key, cache_salt)`).
- 0.5.17 to 0.5.22: `extra_key`. It keys the radix cache and HiCache's host tier (`RadixKey.extra_key`),
  but HiCache's storage keys ignore it: with `sglang.hicache`, salted requests are refused.
- older, or no version: salted requests are refused.

The same releases fold a LoRA adapter into `extra_key`: on a release whose storage keys ignore it,
HiCache storage with LoRA is a set-up the service refuses at start (`lora_refusal`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from xavier_core.runtime.errors import FailedPrecondition

__all__ = ["SaltField", "SaltSupport", "lora_refusal", "salt_support"]

_SALT_FIELD_FROM = (0, 5, 23)
"""The first release whose `/generate` takes `cache_salt` and seeds the storage key chain with it."""
_EXTRA_KEY_FROM = (0, 5, 17)
"""The first release read whose `/generate` takes `extra_key` into the radix key."""
LORA_FLAGS = ("--enable-lora", "--lora-paths")


class SaltField(enum.Enum):
    """The `/generate` field that carries the salt."""

    CACHE_SALT = "cache_salt"
    EXTRA_KEY = "extra_key"


@dataclass(frozen=True)
class SaltSupport:
    """Whether, and through which field, one SGLang replica isolates a request's salt."""

    release: str
    """SGLang's version as `/server_info` reported it ("" when it did not)."""
    field: SaltField | None
    """The field that carries the salt; None: salted requests are refused."""
    why: str = ""
    """Why salted requests are refused (when `field` is None)."""

    def apply(self, body: dict[str, Any], salt: str) -> None:
        """Puts `salt` into the `/generate` `body`; `FailedPrecondition` (CACHE_SALT_UNSUPPORTED, naming
        the release) when this replica cannot isolate it. An empty salt changes nothing."""
        if not salt:
            return
        if self.field is None:
            release = self.release or "unknown"
            raise FailedPrecondition(
                f"SGLang {release} on this replica cannot isolate a cache_salt: {self.why}",
                reason="CACHE_SALT_UNSUPPORTED",
                release=release,
                why=self.why,
            )
        body[self.field.value] = salt


def _release_tuple(release: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", release)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def salt_support(release: str, *, storage: bool) -> SaltSupport:
    """The salt field of SGLang `release`; `storage`: HiCache with a storage backend (the Xavier store)."""
    version = _release_tuple(release)
    if version is None:
        return SaltSupport(release, None, "the service could not read SGLang's release from /server_info")
    if version >= _SALT_FIELD_FROM:
        return SaltSupport(release, SaltField.CACHE_SALT)
    if version < _EXTRA_KEY_FROM:
        return SaltSupport(release, None, "releases before 0.5.17 are not known to take a per-request key")
    if storage:
        return SaltSupport(
            release, None, "its HiCache storage keys ignore a request's extra_key (0.5.23 seeds them)"
        )
    return SaltSupport(release, SaltField.EXTRA_KEY)


def lora_refusal(release: str, *, storage: bool, extra_args: list[str]) -> str:
    """Why HiCache storage with LoRA cannot run on `release` ("" when it can): below 0.5.23 the storage
    keys ignore the adapter, so two adapters would share store pages."""
    version = _release_tuple(release)
    lora = any(a.split("=", 1)[0] in LORA_FLAGS for a in extra_args)
    if not (storage and lora) or (version is not None and version >= _SALT_FIELD_FROM):
        return ""
    return (
        f"SGLang {release or '(release unknown)'} keys HiCache storage pages without the LoRA adapter: "
        "sglang.hicache with --enable-lora / --lora-paths needs SGLang 0.5.23 or later"
    )
