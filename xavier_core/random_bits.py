"""Random numbers that need no secrecy (sampling seeds, handoff ids), drawn without a system call.

`secrets` reads the OS's random source on every draw: one system call, with the GIL released and taken
again, per request on a hot path. These come from a private generator seeded once from that source (and
again in a forked child, so two processes never share a sequence). Anything a caller must not be able
to guess (tokens that authorize a read) still comes from `secrets`.
"""

from __future__ import annotations

import os
import random

_RNG = random.Random()  # seeded from os.urandom
os.register_at_fork(after_in_child=_RNG.seed)


def randbits(k: int) -> int:
    """A random int of `k` bits."""
    return _RNG.getrandbits(k)


__all__ = ["randbits"]
