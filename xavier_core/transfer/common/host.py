"""Which host, since which boot, a process runs on: what same-host shortcuts (CUDA IPC handles, reading a
page store's memory) check before they take effect."""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["boot_id"]


@functools.cache
def boot_id() -> str:
    """This host's kernel boot id (empty where the kernel does not say): two processes with the same one run
    on the same host, since this boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
