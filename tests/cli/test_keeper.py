"""The restart policy of `xavier up` on stand-in services: backoff, a bounded budget per window, addresses
kept across restarts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from xavier_cli.supervisor import GaveUp, Keeper, RestartPolicy, Supervisor, describe_exit

# A stand-in service: writes its ready file (with the address it was told to listen on) and sleeps.
_SCRIPT = """#!/bin/sh
ready="$2"; shift 2
echo "{\\"address\\": \\"$2\\", \\"pid\\": $$}" > "$ready"
exec sleep 60
"""


def _service(tmp_path: Path) -> str:
    script = tmp_path / "fake-service"
    script.write_text(_SCRIPT)
    script.chmod(0o755)
    return str(script)


def _tick_until(keeper: Keeper, done: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:  # type: ignore[operator]
        keeper.tick()
        time.sleep(0.02)
    assert done(), "condition not reached"  # type: ignore[operator]


def test_restarts_with_backoff_then_gives_up(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    said: list[str] = []
    child = sup.start("svc", _service(tmp_path), ["--listen", "127.0.0.1:4321"])
    _tick_until(Keeper(sup, RestartPolicy(), said.append), child.poll_ready)
    keeper = Keeper(sup, RestartPolicy(max_restarts=2, window_seconds=60, backoff_seconds=0.05), said.append)
    try:
        for attempt in (1, 2):
            old = sup.children[0]
            os.kill(old.proc.pid, signal.SIGKILL)
            _tick_until(keeper, lambda old=old: sup.children[0] is not old and sup.children[0].poll_ready())
            fresh = sup.children[0]
            assert fresh.proc.pid != old.proc.pid and fresh.address == "127.0.0.1:4321"
            assert keeper.restarts == attempt
        _tick_until(keeper, lambda: any("is back at" in s for s in said))
        os.kill(sup.children[0].proc.pid, signal.SIGKILL)
        sup.children[0].proc.wait(5)
        with pytest.raises(GaveUp, match="svc exited \\(signal SIGKILL\\) after 2 restart"):
            keeper.tick()
    finally:
        sup.stop_all(grace=2)
    assert any("restart 1 of 2" in s for s in said) and any("restart 2 of 2" in s for s in said)


def test_backoff_doubles_and_is_capped() -> None:
    policy = RestartPolicy(backoff_seconds=0.5, max_backoff_seconds=3.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert describe_exit(-9) == "signal SIGKILL" and describe_exit(3) == "exit 3"
