"""`TroubleLog`: one line when trouble starts, at most one per interval while it lasts (with the count
since the last line), one when the store answers again. A hand-moved clock: no timing."""

from __future__ import annotations

import logging

import pytest

from xavier_core.pagestore.trouble import TroubleLog


def test_failure_lines_are_rate_limited_and_recovery_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    trouble = TroubleLog(logging.getLogger("trouble-test"), 30.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="trouble-test")
    trouble.ok()  # healthy: nothing to say
    for _ in range(5):
        trouble.failed("get", TimeoutError("deadline"))
    assert caplog.messages == ["page store get failed, served as a miss: deadline"]
    now[0] += 31
    trouble.failed("exists", TimeoutError("deadline"))
    assert len(caplog.messages) == 2 and "5 calls served as misses" in caplog.messages[1]
    trouble.ok()
    trouble.ok()
    assert caplog.messages[2:] == ["page store answering again after 6 failed calls"]
    trouble.failed("put", OSError("refused"))  # a new stretch is logged at once
    assert caplog.messages[3:] == ["page store put failed, served as a miss: refused"]
