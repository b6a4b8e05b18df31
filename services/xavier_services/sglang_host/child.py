"""The SGLang server process: start, wait for /health, notice its death, stop it without orphans.

The child runs in its own process group (SGLang forks scheduler and detokenizer processes: a stop signals
the whole group) and dies with the service through `PR_SET_PDEATHSIG` (see `pdeathsig`). Its output goes
to the service's stderr with a prefix, and the last lines are kept for the death report.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
import time

import aiohttp

from xavier_core.runtime.errors import Unavailable
from xavier_core.runtime.logging import get_logger
from xavier_services.sglang_host.launch import Launch

log = get_logger(__name__)
_TAIL_LINES = 40
_HEALTH_POLL_SECONDS = 0.25


class ChildFailed(Unavailable):
    """SGLang did not come up, or died."""

    reason = "PEER_UNAVAILABLE"


class SglangChild:
    """One SGLang server process."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.proc: asyncio.subprocess.Process | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.stopping = False
        self._pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    async def start(self) -> None:
        wrapper = [sys.executable, "-m", "xavier_services.sglang_host.pdeathsig", str(os.getpid()), "--"]
        self.proc = await asyncio.create_subprocess_exec(
            *wrapper,
            *self.launch.argv,
            env={**os.environ, **self.launch.env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self._pump = asyncio.create_task(self._copy_output(), name="sglang-output")
        log.info("sglang started", pid=self.proc.pid, url=self.launch.url)

    async def _copy_output(self) -> None:
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        while True:
            try:
                raw = await proc.stdout.readline()
            except ValueError:
                # A line past the stream's limit (a progress bar redrawn with '\r'): the reader dropped
                # it. Reading on matters: a pipe nobody drains blocks SGLang on its next write.
                self.tail.append("[a line too long to copy was dropped]")
                continue
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            sys.stderr.write(f"[sglang] {line}\n")

    def exit_detail(self) -> str:
        """The exit code (or signal) and the last lines SGLang printed."""
        code = self.proc.returncode if self.proc is not None else None
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        tail = "\n".join(list(self.tail)[-10:])
        return f"SGLang exited ({how}); last output:\n{tail}" if tail else f"SGLang exited ({how})"

    async def healthy(self, session: aiohttp.ClientSession, timeout: float) -> bool:
        """One GET /health: True on 200."""
        url = f"{self.launch.url}/health"
        headers = {"Authorization": f"Bearer {self.launch.api_key}"}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status == 200
        return False

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout: float) -> None:
        """Polls GET /health until 200; `ChildFailed` if the process exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.returncode is not None:
                await self._drain_output()
                raise ChildFailed(f"SGLang did not start: {self.exit_detail()}")
            if await self.healthy(session, 5.0):
                log.info("sglang healthy", url=self.launch.url)
                return
            if time.monotonic() > deadline:
                raise ChildFailed(f"SGLang's /health did not answer 200 within {timeout:.0f}s")
            await asyncio.sleep(_HEALTH_POLL_SECONDS)

    async def wait_exit(self) -> int:
        """Returns the exit code once the process ended (output copied)."""
        if self.proc is None:
            return 0
        code = await self.proc.wait()
        await self._drain_output()
        return code

    async def _drain_output(self) -> None:
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._pump), 2.0)

    async def stop(self, grace: float) -> None:
        """SIGTERM to the process group, then SIGKILL to it after `grace` seconds; waits for the exit."""
        self.stopping = True
        proc = self.proc
        if proc is None or proc.returncode is not None:
            self._kill_group(signal.SIGKILL)  # stragglers of a leader that already exited
            return
        self._kill_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log.warning("sglang ignored SIGTERM; killing it", pid=proc.pid, grace_seconds=grace)
        self._kill_group(signal.SIGKILL)
        await proc.wait()
        await self._drain_output()
        log.info("sglang stopped", pid=proc.pid, code=proc.returncode)

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
