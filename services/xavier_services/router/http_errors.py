"""What aiohttp answers on its own, before the OpenAI front's handlers run, in OpenAI's error shape.

aiohttp answers a request it cannot parse with a ``text/plain`` page of its own that quotes the client's
bytes back. `JsonErrorProtocol` is aiohttp's protocol with that answer replaced:

- a request aiohttp's parser refuses (request line, method, version or URL; a header, Content-Length,
  Transfer-Encoding or chunk framing; a line past 8,190 bytes or too many headers) is a 400
  ``MALFORMED_HTTP`` whose ``param`` names the header where the parser names one; a Content-Encoding
  the router cannot decode (``br``) is the 400 ``INVALID_JSON`` naming ``Content-Encoding`` that the
  front gives an encoding it refuses itself (`OpenAiFront._body`);
- a failure outside the front's middleware (none is known) is a 500 ``INTERNAL`` (504 for a timeout).

The parser's message is cut to its description, so nothing the client sent is echoed. aiohttp closes the
connection after each of these, and so does this. (An ``Expect`` other than ``100-continue`` is
answered by the front's routes: `OpenAiFront.expect`, a 417 of the same shape.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, InvalidURLError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from xavier_core.runtime import InvalidArgument
from xavier_services.router.openai_http import error_response, json_error

__all__ = ["JsonErrorProtocol", "describe", "json_error_protocols"]

# Headers a parser error may be about, so that `param` names the one at fault.
_HEADERS = ("Content-Length", "Transfer-Encoding", "Content-Encoding", "Host")
# Where the parser starts quoting the client's bytes ("Invalid header token:\n\n  b'X a: 1'\n    ^").
_QUOTE = re.compile(r"""\s*(?:b'|b"|bytearray\(|\^).*""", re.DOTALL)


def describe(exc: HttpProcessingError) -> tuple[str, str | None]:
    """A parser error's description (no byte of the request in it) and the header it is about, if any."""
    if isinstance(exc, LineTooLong):
        return "a request line or header line is longer than the front reads (8,190 bytes)", None
    if isinstance(exc, InvalidURLError):
        return "the request target is not a valid URL path", None
    parts = []
    for line in exc.message.splitlines():
        text = _QUOTE.sub("", line).strip().rstrip(":").strip()
        if text:
            parts.append(text)
    description = ": ".join(parts)[:200] or "the request could not be parsed"
    lowered = description.lower()
    named = [(lowered.find(h.lower()), h) for h in _HEADERS if h.lower() in lowered]
    return description, min(named)[1] if named else None


class JsonErrorProtocol(RequestHandler):
    """aiohttp's protocol for one connection; its own error answers in OpenAI's JSON error shape."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # an answer already started: only closing is left
            raise ConnectionError("the response started before the error; the connection is closed")
        if isinstance(exc, ContentEncodingError):
            err = InvalidArgument(
                "the request body's Content-Encoding is not supported (identity, gzip, deflate)",
                reason="INVALID_JSON",
                param="Content-Encoding",
            )
            resp = error_response(err)
        elif isinstance(exc, HttpProcessingError) and 400 <= status < 500:
            description, header = describe(exc)
            self.logger.debug("HTTP request refused by the parser: %s", description)
            named = {"param": header} if header else {}
            err = InvalidArgument(
                f"the request is not valid HTTP/1.1: {description}", reason="MALFORMED_HTTP", **named
            )
            resp = error_response(err) if status == 400 else _with_param(status, err)
        else:
            self.log_exception("error handling an HTTP request", exc_info=exc)
            reason = "DEADLINE_EXCEEDED" if status == HTTPStatus.GATEWAY_TIMEOUT else "INTERNAL"
            resp = json_error(status, HTTPStatus(status).phrase.lower(), reason=reason)
        resp.force_close()
        return resp


def _with_param(status: int, err: InvalidArgument) -> web.Response:
    """`err` answered with a status other than its code's (a parser's 4xx other than 400)."""
    return json_error(status, err.message, reason=err.reason, param=err.metadata.get("param"))


def json_error_protocols(server: web.Server) -> Callable[[], JsonErrorProtocol]:
    """The protocol factory of `server` (an `AppRunner`'s), making `JsonErrorProtocol`s."""

    def make() -> JsonErrorProtocol:
        # aiohttp's own factory (Server.__call__) builds a RequestHandler with the same arguments.
        return JsonErrorProtocol(server, loop=server._loop, **server._kwargs)

    return make
