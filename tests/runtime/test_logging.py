"""JSON log lines carry timestamp, level, service and the RPC's request id from contextvars."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import structlog

from xavier_core.runtime import REQUEST_ID_KEY, configure_logging, get_logger

from .conftest import SERVICE


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    configure_logging("logsvc", "info", "json", stream=stream)
    yield stream
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_xavier_handler", False)]:
        root.removeHandler(handler)


async def test_json_lines_with_request_id(serve_handlers: Any, log_stream: io.StringIO) -> None:
    log = get_logger("xavier.test")

    async def handler(request: bytes, context: Any) -> bytes:
        log.info("handled", size=len(request))
        logging.getLogger("third.party").warning("stdlib too")
        return b""

    handle = await serve_handlers({"Log": grpc.unary_unary_rpc_method_handler(handler)})
    async with grpc.aio.insecure_channel(handle.address) as channel:
        await channel.unary_unary(f"/{SERVICE}/Log")(b"abc", metadata=((REQUEST_ID_KEY, "rid-1"),), timeout=5)
    events = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    handled = next(e for e in events if e["event"] == "handled")
    assert handled["request_id"] == "rid-1" and handled["rpc"] == f"/{SERVICE}/Log" and handled["size"] == 3
    assert handled["service"] == "logsvc" and handled["logger"] == "xavier.test"
    assert handled["level"] == "info" and handled["timestamp"].endswith("Z")
    stdlib = next(e for e in events if e["event"] == "stdlib too")
    assert (
        stdlib["request_id"] == "rid-1" and stdlib["level"] == "warning" and stdlib["logger"] == "third.party"
    )


def test_level_filters(log_stream: io.StringIO) -> None:
    configure_logging("logsvc", "warning", "json", stream=log_stream)
    log = get_logger()
    log.info("hidden")
    log.warning("shown")
    lines = [json.loads(x) for x in log_stream.getvalue().splitlines()]
    assert [x["event"] for x in lines] == ["shown"]
    assert lines[0]["service"] == "logsvc"
