"""Child processes for `xavier up`: start with a ready file, restart the ones that die (bounded, with
backoff), stop all with nothing left behind."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if `xavier up` dies without cleaning up (even on SIGKILL).
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    """One started service process."""

    name: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    stage: int = 0
    binary: str = ""
    args: tuple[str, ...] = ()
    started: float = field(default_factory=time.monotonic)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return str(self.info.get("address", ""))

    def poll_ready(self) -> bool:
        if not self.info and self.ready_file.exists():
            self.info = json.loads(self.ready_file.read_text())
        return bool(self.info)

    @property
    def metrics(self) -> str:
        return str(self.info.get("metrics") or "")

    def restart_args(self) -> list[str]:
        """The arguments of a restart: the addresses the first run bound (a `:0` port became a real one),
        so the peers and the router that know this service's address keep reaching it."""
        pinned = {"--listen": self.address, "--http": str(self.info.get("http") or "")}
        args = list(self.args)
        for i, arg in enumerate(args[:-1]):
            if pinned.get(arg):
                args[i + 1] = pinned[arg]
        return args

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Supervisor:
    """Starts console scripts (`xavier-directory`, ...) and stops them in reverse order."""

    def __init__(
        self,
        workdir: Path,
        env: dict[str, str] | None = None,
        env_for: Callable[[str], dict[str, str]] | None = None,
    ) -> None:
        self.workdir = workdir
        self.env = {**os.environ, **(env or {})}
        self.env_for = env_for
        """Extra environment of one child by name (its own certificate), on every start and restart."""
        self.children: list[Child] = []

    def start(self, name: str, binary: str, args: Sequence[str], stage: int = 0) -> Child:
        """Starts `binary` with a ready file and a log."""
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        exe = Path(sys.executable).parent / binary
        cmd = [str(exe) if exe.exists() else binary, "--ready-file", str(ready), *args]
        with open(log_path, "ab") as log:  # a restart appends: the log of the run that died stays
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **self.env_for(name)} if self.env_for is not None else self.env,
                start_new_session=True,  # Ctrl-C reaches only `xavier up`, which stops children in order
                preexec_fn=_die_with_parent,
            )
        child = Child(name, proc, ready, log_path, stage, binary, tuple(args))
        self.children.append(child)
        return child

    def respawn(self, old: Child) -> Child:
        """Starts a dead child again in its place, on the addresses it had."""
        self.children.remove(old)
        return self.start(old.name, old.binary, old.restart_args(), old.stage)

    def wait_ready(
        self,
        children: Sequence[Child],
        timeout: float,
        should_stop: Callable[[], bool],
        progress: Callable[[Child, float], None],
        ready: Callable[[Child], None],
    ) -> bool:
        """Waits until every child wrote its ready file; False on timeout, a dead child or a stop request."""
        pending = list(children)
        deadline = time.monotonic() + timeout
        last_note = time.monotonic()
        while pending:
            if should_stop():
                return False
            for child in list(pending):
                if child.poll_ready():
                    pending.remove(child)
                    ready(child)
                elif child.proc.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}"
                    )
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"not ready after {timeout:.0f}s: {', '.join(c.name for c in pending)}")
            if pending and now - last_note >= 2.0:
                last_note = now
                for child in pending:
                    progress(child, now - child.started)
            time.sleep(0.05)
        return True

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM stage by stage, highest first (router, then peers together, then the directory);
        SIGKILL whatever outlives `grace`."""
        for stage in sorted({c.stage for c in self.children}, reverse=True):
            group = [c for c in self.children if c.stage == stage]
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for child in group:
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait(5)
        for child in self.children:
            child.ready_file.unlink(missing_ok=True)


def describe_exit(code: int | None) -> str:
    """`exit 3` or `signal SIGKILL` for a Popen return code."""
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


@dataclass(frozen=True)
class RestartPolicy:
    """At most `max_restarts` restarts of one service within `window_seconds`; the n-th restart in the
    window waits `backoff_seconds * 2**(n-1)`, capped at `max_backoff_seconds`. 0 restarts: a death ends
    the mesh."""

    max_restarts: int = 5
    window_seconds: float = 60.0
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 10.0
    ready_timeout_seconds: float = 300.0

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_seconds, self.backoff_seconds * 2.0 ** max(0, attempt - 1))


class GaveUp(RuntimeError):
    """A service died more often than the restart policy allows."""


class Keeper:
    """Watches the started children: a dead one is restarted after its backoff, a restarted one is
    reported when ready again (or killed, and so retried, when it is not ready in time)."""

    def __init__(self, sup: Supervisor, policy: RestartPolicy, say: Callable[[str], None]) -> None:
        self.sup = sup
        self.policy = policy
        self.say = say
        self.restarts = 0
        self._history: dict[str, deque[float]] = {}
        self._due: dict[str, float] = {}
        self._starting: dict[str, float] = {}

    def tick(self) -> None:
        """One pass over the children; raises `GaveUp` when a service's restarts are exhausted."""
        now = time.monotonic()
        for child in list(self.sup.children):
            name = child.name
            due = self._due.get(name)
            if due is not None:
                if now >= due:
                    del self._due[name]
                    self._starting[name] = now
                    fresh = self.sup.respawn(child)
                    self.say(f"restarting {name} (pid {fresh.proc.pid})")
            elif child.proc.poll() is not None:
                self._died(child, now)
            elif name in self._starting:
                if child.poll_ready():
                    del self._starting[name]
                    self.say(f"{name} is back at {child.address} (metrics {child.metrics or 'off'})")
                elif now - self._starting[name] > self.policy.ready_timeout_seconds:
                    self.say(f"{name} not ready {self.policy.ready_timeout_seconds:.0f}s after its restart")
                    child.proc.kill()  # seen dead on the next pass, which counts another restart

    def _died(self, child: Child, now: float) -> None:
        self._starting.pop(child.name, None)
        history = self._history.setdefault(child.name, deque())
        while history and now - history[0] > self.policy.window_seconds:
            history.popleft()
        how = describe_exit(child.proc.returncode)
        print(f"{child.name} exited ({how}); its log ends:\n{child.log_tail()}", file=sys.stderr, flush=True)
        if len(history) >= self.policy.max_restarts:
            raise GaveUp(
                f"{child.name} exited ({how}) after {len(history)} restart(s) in "
                f"{self.policy.window_seconds:.0f}s; giving up"
            )
        history.append(now)
        self.restarts += 1
        delay = self.policy.delay(len(history))
        self._due[child.name] = now + delay
        self.say(
            f"{child.name} exited ({how}); restart {len(history)} of {self.policy.max_restarts} "
            f"in {self.policy.window_seconds:.0f}s, in {delay:.1f}s"
        )
