"""systemd notification protocol (``Type=notify``) in the standard library only.

Messages go as one datagram to the AF_UNIX socket named by ``NOTIFY_SOCKET``
(a leading ``@`` means the Linux abstract namespace). Without the variable
every call is a no-op, so services behave the same outside systemd.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

__all__ = ["notify", "watchdog_interval", "watchdog_loop"]


def _address(env: Mapping[str, str]) -> str | None:
    addr = env.get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in ("/", "@"):
        return None
    return "\0" + addr[1:] if addr[0] == "@" else addr


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``, ``"STATUS=draining"``); True when sent.

    Failures are swallowed: a missing notification must never take a service down.
    """
    addr = _address(os.environ if env is None else env)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval(override: float | None = None, env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings, or None when no watchdog is wanted.

    ``override`` (config ``watchdog_seconds``): 0 disables, > 0 is used as is.
    Otherwise half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises,
    and only when ``WATCHDOG_PID`` (if set) is this process.
    """
    environ = os.environ if env is None else env
    if _address(environ) is None:
        return None
    if override is not None:
        return override if override > 0 else None
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2_000_000


async def watchdog_loop(interval: float, env: Mapping[str, str] | None = None) -> None:
    """Ping ``WATCHDOG=1`` every ``interval`` seconds until cancelled.

    It runs on the service's event loop on purpose: a loop blocked by
    synchronous work stops the pings and systemd restarts the service.
    """
    while True:
        notify("WATCHDOG=1", env)
        await asyncio.sleep(interval)
