"""structlog setup: one JSON object per line on stderr, or a console renderer on a TTY.

stdout stays clean (CLIs print results there). Standard-library loggers
(grpc, asyncio, third parties) go through the same renderer, so a service's
stderr is uniformly JSON when it runs under systemd or a supervisor.
"""

from __future__ import annotations

import logging as stdlib_logging
import sys
from typing import Any, Literal, TextIO

import structlog
from structlog.types import EventDict, Processor, WrappedLogger

__all__ = ["configure_logging", "get_logger"]

_LEVELS = {
    "debug": stdlib_logging.DEBUG,
    "info": stdlib_logging.INFO,
    "warning": stdlib_logging.WARNING,
    "error": stdlib_logging.ERROR,
    "critical": stdlib_logging.CRITICAL,
}


def get_logger(name: str | None = None, **initial: Any) -> Any:
    """A lazy structlog logger (``name`` becomes the ``logger`` field, as for stdlib loggers).

    Safe at module level: it binds to whatever configuration is current when it first logs.
    """
    if name is not None:
        # ``logger`` is a parameter of structlog.get_logger; renamed by _logger_field.
        initial["logger_name"] = name
    return structlog.get_logger(**initial)


def _logger_field(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    name = event.pop("logger_name", None)
    if name is not None:
        event["logger"] = name
    return event


def _service_default(service: str) -> Processor:
    def add_service(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
        # setdefault: a caller may bind its own ``service`` (several services
        # sharing one process, e.g. ``xavier up`` in-process).
        event.setdefault("service", service)
        return event

    return add_service


def configure_logging(
    service: str,
    level: str = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    stream: TextIO | None = None,
) -> None:
    """Configure structlog and stdlib logging for a service process.

    ``fmt="auto"`` renders JSON unless ``stream`` (stderr by default) is a TTY.
    Every event carries timestamp (ISO 8601 UTC), level, service and whatever
    is bound in structlog contextvars (``request_id``, ``rpc``).
    """
    out = stream if stream is not None else sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    numeric = _LEVELS.get(level.lower(), stdlib_logging.INFO)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _service_default(service),
        _logger_field,
    ]
    renderer: Processor
    if use_json:
        renderer = structlog.processors.JSONRenderer()
        # Tracebacks as dicts, without frame locals: they are large and may hold request data.
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        tail: list[Processor] = [tracebacks, renderer]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
        tail = [renderer]
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *tail],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *tail,
        ],
    )
    handler = stdlib_logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = stdlib_logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_xavier_handler", False):
            root.removeHandler(old)
    handler._xavier_handler = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric)
