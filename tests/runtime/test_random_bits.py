"""Random bits without a system call: in range, and a forked child never repeats its parent's sequence."""

from __future__ import annotations

import os

from xavier_core.random_bits import randbits


def test_draws_fit_their_bits() -> None:
    draws = [randbits(63) for _ in range(1000)]
    assert all(0 <= d < 1 << 63 for d in draws)
    assert len(set(draws)) == len(draws)


def test_a_forked_child_draws_its_own_sequence() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next draws, to the parent
        os.close(read)
        os.write(write, b",".join(str(randbits(63)).encode() for _ in range(4)))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = [int(v) for v in pipe.read().split(b",")]
    os.waitpid(pid, 0)
    parent = [randbits(63) for _ in range(4)]
    assert child != parent
