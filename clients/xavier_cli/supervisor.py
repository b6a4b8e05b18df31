"""Child processes for `xavier up`: start with a ready file, watch, stop all with nothing left behind."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
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
    started: float = field(default_factory=time.monotonic)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return str(self.info.get("address", ""))

    def poll_ready(self) -> bool:
        if not self.info and self.ready_file.exists():
            self.info = json.loads(self.ready_file.read_text())
        return bool(self.info)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Supervisor:
    """Starts console scripts (`xavier-directory`, ...) and stops them in reverse order."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.env = {**os.environ, **(env or {})}
        self.children: list[Child] = []

    def start(self, name: str, binary: str, args: Sequence[str], stage: int = 0) -> Child:
        """Starts `binary` with a ready file and a log."""
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        exe = Path(sys.executable).parent / binary
        cmd = [str(exe) if exe.exists() else binary, "--ready-file", str(ready), *args]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # Ctrl-C reaches only `xavier up`, which stops children in order
                preexec_fn=_die_with_parent,
            )
        child = Child(name, proc, ready, log_path, stage)
        self.children.append(child)
        return child

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
