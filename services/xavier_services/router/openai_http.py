"""OpenAI-compatible HTTP front on aiohttp: /v1/models, /v1/completions, /v1/chat/completions (SSE)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import HttpVersion11, hdrs, web
from aiohttp.web_protocol import RequestPayloadError
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2

from xavier_core.runtime import InvalidArgument, XavierError
from xavier_services.router.core import Router
from xavier_services.router.http_guard import GuardedProtocol
from xavier_services.router.keepalive import Keepalive
from xavier_services.router.openai_body import decode_json
from xavier_services.router.openai_logprobs import ChoiceLogprobs, prompt_rows
from xavier_services.router.openai_shapes import (
    FINISH_NAMES,
    OpenAiRequest,
    TextChunks,
    choice,
    envelope,
    parse,
    sse,
    usage_json,
)
from xavier_services.router.openai_stream import Choices, close_quietly, merge
from xavier_services.router.openai_tools import tool_message, tool_parser
from xavier_services.router.request import Prepared
from xavier_services.router.tool_stream import ToolEvent, delta_of

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_REASON_STATUS = {
    # An answer larger than a gRPC message may carry (a long prompt's logprobs): asking again cannot help.
    "MESSAGE_TOO_LARGE": 400,
}
"""Reasons whose HTTP status is not their gRPC code's."""
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_log = logging.getLogger("xavier.router.http")
# One sequence's answer: its text, its logprobs (when asked), its last message, its cumulative logprob.
Answer = tuple[str, dict[str, Any] | None, rpb.GenerateResponse, float]


def best_answers(answers: list[Answer], n: int, best_of: int) -> list[Answer]:
    """Each prompt's `n` answers of highest cumulative logprob, best first, out of its `best_of`
    (`answers` holds them prompt after prompt); all of them, in order, when `best_of` is `n`."""
    if best_of == n:
        return answers
    out: list[Answer] = []
    for start in range(0, len(answers), best_of):
        group = answers[start : start + best_of]
        out += sorted(group, key=lambda a: -a[3])[:n]
    return out


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_error(status: int, message: str, *, reason: str, param: str | None = None) -> web.Response:
    """OpenAI's error shape for a status the gRPC mapping does not produce (413, 404, 405, 417, 500)."""
    kind = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": reason}}
    return web.json_response(body, status=status)


def error_response(err: XavierError) -> web.Response:
    """`{"error": {message, type, param, code}}` with the HTTP status of the gRPC code; code is the reason."""
    status = _REASON_STATUS.get(err.reason) or _HTTP_STATUS.get(err.code, 500)
    body = {
        "error": {
            "message": err.message or err.reason,
            "type": _ERROR_TYPE.get(status, "server_error"),
            "param": err.metadata.get("param"),
            "code": err.reason,
        }
    }
    retry_after = err.metadata.get("retry_after_seconds")
    headers = {"Retry-After": retry_after} if status == 429 and retry_after else None
    return web.json_response(body, status=status, headers=headers)


_ENCODINGS = frozenset(("identity", "gzip", "deflate"))


class _BodyTimeout(Exception):
    """The request body did not arrive in time (answered 408 by the error middleware)."""


"""Request body encodings aiohttp decodes (brotli needs a package the router does not install)."""


class OpenAiFront:
    """The HTTP handlers; they call the same `Router` as the gRPC servicer."""

    def __init__(self, router: Router, default_max_tokens: int = 16) -> None:
        self.router = router
        self.default_max_tokens = default_max_tokens

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.router.config.http_max_body_bytes,
            middlewares=[self._connection, self._errors, *self._auth()],
        )
        expect = self.expect
        app.router.add_get("/v1/models", self.models, expect_handler=expect)
        app.router.add_get("/v1/models/{model:.+}", self.model, expect_handler=expect)
        app.router.add_post("/v1/completions", self.completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=expect)
        app.router.add_get("/health", self.health, expect_handler=expect)
        return app

    @staticmethod
    async def expect(request: web.Request) -> None:
        """``Expect: 100-continue`` gets its interim answer; any other expectation a JSON 417. (aiohttp's
        own answer is text/plain, sent before the middleware runs.)"""
        if request.headers.get(hdrs.EXPECT, "").strip().lower() != "100-continue":
            body = json_error(
                417, "Expect must be 100-continue", reason="MALFORMED_HTTP", param="Expect"
            ).text
            raise web.HTTPExpectationFailed(text=body, content_type="application/json")
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer proper has not started yet

    def _auth(self) -> list[Any]:
        token = self.router.config.bearer_token
        if not token:
            return []
        expected = f"Bearer {token}".encode()

        @web.middleware
        async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path != "/health":
                given = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    err = XavierError("missing or wrong bearer token", reason="UNAUTHENTICATED")
                    err.code = grpc.StatusCode.UNAUTHENTICATED
                    return error_response(err)
            return await handler(request)

        return [auth]

    @web.middleware
    async def _connection(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Tells the connection guard when a request's headers are in and when it is answered."""
        proto = request.transport.get_protocol() if request.transport is not None else None
        guarded = proto if isinstance(proto, GuardedProtocol) else None
        if guarded is not None:
            guarded.request_started()
        try:
            return await handler(request)
        finally:
            if guarded is not None:
                guarded.request_done()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except XavierError as err:
            return error_response(err)
        except _BodyTimeout:
            limit_s = self.router.config.http_body_timeout_seconds
            return json_error(
                408, f"the request body did not arrive within {limit_s:g} s", reason="REQUEST_TIMEOUT"
            )
        except web.HTTPRequestEntityTooLarge:
            limit = self.router.config.http_max_body_bytes
            return json_error(
                413, f"the request body is larger than {limit} bytes", reason="REQUEST_TOO_LARGE"
            )
        except web.HTTPException as exc:  # 404 / 405 from routing: the same JSON shape as every error
            if exc.status < 400:
                raise
            if exc.status >= 500:
                return json_error(exc.status, exc.reason, reason="INTERNAL")
            return json_error(exc.status, exc.reason, reason="INVALID_REQUEST")
        except Exception:
            # A bug, not bad input: logged with its traceback; the client gets JSON, not aiohttp's text page.
            _log.exception("unhandled error in %s %s", request.method, request.path)
            return json_error(500, "internal error", reason="INTERNAL")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _model_entry(self) -> dict[str, Any]:
        return {
            "id": self.router.model.name,
            "object": "model",
            "created": 0,
            "owned_by": "xavier",
            "max_model_len": self.router.model.max_context,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}` (the OpenAI SDK's `models.retrieve`): this router's model, else 404."""
        name = request.match_info["model"]
        if name != self.router.model.name:
            served = self.router.model.name
            return json_error(
                404, f"model {name!r} does not exist; this router serves {served!r}", reason="UNKNOWN_MODEL"
            )
        return web.json_response(self._model_entry())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _body(self, request: web.Request) -> Any:
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in _ENCODINGS:
            raise InvalidArgument(
                f"Content-Encoding {encoding[:40]!r} is not supported (identity, gzip, deflate)",
                reason="INVALID_JSON",
            )
        # read() raises HTTPRequestEntityTooLarge past client_max_size: the middleware answers JSON 413.
        try:
            raw = await asyncio.wait_for(request.read(), self.router.config.http_body_timeout_seconds)
        except TimeoutError:
            raise _BodyTimeout from None
        except RequestPayloadError:  # a body that is not in its Content-Encoding, or cut short
            raise InvalidArgument(
                f"the request body could not be read as {encoding} (malformed or cut short)",
                reason="INVALID_JSON",
            ) from None
        return decode_json(raw)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        oa = parse(body, chat, self.router.model.name, self.default_max_tokens)
        # Every prompt is checked before anything runs or any byte is sent: a clean HTTP 400.
        try:
            preps = [await self.router.prepare_async(r) for r in (oa.request, *oa.more)]
        except XavierError as err:
            if err.metadata.get("param") == "max_tokens" and body.get("max_completion_tokens") is not None:
                err.metadata["param"] = "max_completion_tokens"  # the name this client used
            raise
        if oa.max_tokens_to_context:
            for prep in preps:
                prep.sampling.max_tokens = self.router.model.max_context - len(prep.token_ids)
        if oa.stream:
            return await self._stream(request, oa, preps)
        # A prompt batch and n > 1 run their requests side by side; choices keep OpenAI's order.
        try:
            answers = await self._answers(oa, preps)
        except XavierError as err:
            oa.name_params(err)
            raise
        usage = types_pb2.Usage()
        for _, _, last, _ in answers:  # best_of: every sequence sampled counts, as OpenAI bills it
            usage.completion_tokens += 0 if oa.echo_only else last.usage.completion_tokens
        choices = []
        for i, (text, lp, last, _) in enumerate(best_answers(answers, oa.n, oa.best_of)):
            finish = FINISH_NAMES.get(last.finish_reason)
            one = choice(oa, text, finish, lp, delta=False)
            if oa.tools is not None:
                one["message"], one["finish_reason"] = tool_message(oa.tools, text, finish)
            one["index"] = i
            choices.append(one)
            if i % oa.n == 0:  # a prompt counts once, however many choices it has (as OpenAI's usage)
                usage.prompt_tokens += last.usage.prompt_tokens
                usage.cached_tokens += last.usage.cached_tokens
        out = envelope(oa, choices, chunk=False)
        out["usage"] = usage_json(usage)
        return web.json_response(out)

    async def _answers(self, oa: OpenAiRequest, preps: list[Prepared]) -> list[Answer]:
        """The answers of `preps`, side by side; the first failure cancels the rest and is raised."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._answer(oa, p)) for p in preps]
        except ExceptionGroup as errors:
            raise errors.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _answer(self, oa: OpenAiRequest, prep: Prepared) -> Answer:
        """One request's whole answer: its text (after the prompt's, with `echo`), its logprobs (if
        asked), its last message (with `max_tokens: 0` and `echo`, the token sampled is left out) and
        its cumulative logprob."""
        text, ids, values, tops = "", [], [], []
        prompt: rpb.GenerateResponse | None = None
        last = rpb.GenerateResponse()
        async for msg in self.router.generate(prep):
            prompt = prompt or msg
            text += msg.text
            ids.extend(msg.token_ids)
            values.extend(msg.logprobs)
            tops.extend(msg.top_logprobs)
            last = msg
        score = sum(values)
        if oa.echo_only:
            text, ids, values, tops = "", [], [], []
            last.finish_reason = types_pb2.FINISH_REASON_LENGTH
        shaper = ChoiceLogprobs(self.router.encoder, chat=oa.chat, top=oa.top_logprobs)
        if not oa.echo:
            return text, (shaper.render(ids, values, tops) if oa.logprobs else None), last, score
        echoed = self._prompt_text(prep)
        if not oa.logprobs:
            return echoed + text, None, last, score
        lp = self._echo_logprobs(shaper, prep, prompt)
        more = shaper.render(ids, values, tops)
        if lp is None:  # aborted before its first token: nothing scored the prompt
            return echoed + text, more, last, score
        for key in ("tokens", "token_logprobs", "text_offset"):
            lp[key] += more[key]
        if lp["top_logprobs"] is not None:
            lp["top_logprobs"] += more["top_logprobs"]
        return echoed + text, lp, last, score

    def _prompt_text(self, prep: Prepared) -> str:
        """The text `echo` repeats: the prompt as the client wrote it, or its token ids decoded."""
        if prep.prompt_text is not None:
            return prep.prompt_text
        return self.router.encoder.tokenizer.decode(list(prep.token_ids), skip_special_tokens=False)

    def _echo_logprobs(
        self, shaper: ChoiceLogprobs, prep: Prepared, first: rpb.GenerateResponse | None
    ) -> dict[str, Any] | None:
        """The logprobs of an echoed prompt (the first response carries them; None for a request that
        ended before its first token)."""
        if first is None or not first.HasField("prompt_logprobs"):
            return None
        values, tops = prompt_rows(prep.token_ids, first.prompt_logprobs)
        return shaper.render(prep.token_ids, values, tops)

    async def _stream(
        self, request: web.Request, oa: OpenAiRequest, preps: list[Prepared]
    ) -> web.StreamResponse:
        """Streams every choice (n > 1 and prompt batches side by side, each chunk with its choice's
        index), then the usage of them all when asked for."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        started = False
        shapers = [ChoiceLogprobs(self.router.encoder, chat=oa.chat, top=oa.top_logprobs) for _ in preps]
        plan = oa.tools if oa.tools is not None and oa.tools.choice != "none" else None
        parsers = [tool_parser(plan) for _ in preps] if plan is not None else []
        unsent: list[dict[str, Any] | None] = [None] * len(preps)  # logprobs of held text, per choice
        gens = [self.router.generate(p) for p in preps]  # async generators: closed below
        # One choice is read as it comes (its index is 0); several interleave through `merge`.
        solo = len(gens) == 1
        source: AsyncIterator[Any] = gens[0] if solo else merge(gens)
        # Comments while the answer is quiet, once it started (before, the status is still open for a
        # clean error).
        reader = asyncio.current_task()
        keep = Keepalive(
            resp.write, self.router.config.keepalive_seconds, reader.cancel if reader is not None else None
        )
        seen = Choices(n=oa.n)
        texts = TextChunks(lambda text, index: self._chunk(oa, text, None, None, index))
        try:
            async for item in source:
                keep.touch()
                i, msg = (0, item) if solo else item
                if not started:
                    await resp.prepare(request)
                    started = True
                    keep.start()
                if seen.begin(i):
                    await resp.write(self._opening(oa, preps[i], shapers[i], msg, i))
                if oa.echo_only:  # the token sampled is not part of the answer
                    msg.ClearField("token_ids")
                    msg.text = ""
                    if msg.finish_reason:
                        msg.finish_reason = types_pb2.FINISH_REASON_LENGTH
                        msg.usage.completion_tokens = 0
                lp = None
                if oa.logprobs and msg.token_ids:
                    lp = shapers[i].render(list(msg.token_ids), list(msg.logprobs), list(msg.top_logprobs))
                finish = FINISH_NAMES.get(msg.finish_reason)
                if parsers:  # an answer that may call tools: its calls stream as they are written
                    events = parsers[i].feed(msg.text) + (parsers[i].end() if finish else [])
                    unsent[i] = _joined(unsent[i], lp)
                    if events or finish:
                        calls = parsers[i].calls
                        await resp.write(self._tool_chunks(oa, events, unsent[i], finish, calls, i))
                        unsent[i] = None
                elif msg.text or msg.token_ids or finish:
                    if finish is None and lp is None and (msg.text or not oa.chat):
                        await resp.write(texts.chunk(msg.text, i))  # the common token: its text alone
                    else:
                        await resp.write(self._chunk(oa, msg.text, finish, lp, i))
                if finish:
                    seen.end(i, msg)
            if oa.include_usage:
                # The usage comes last, in a chunk of its own with no choices, as OpenAI sends it.
                last = envelope(oa, [], chunk=True)
                usage = types_pb2.Usage(
                    prompt_tokens=seen.prompt_tokens,
                    cached_tokens=seen.cached_tokens,
                    completion_tokens=seen.completion_tokens,
                )
                last["usage"] = usage_json(usage)
                await resp.write(sse(last))
        except XavierError as err:
            oa.name_params(err)
            if not started:  # nothing sent yet: a proper error status
                return error_response(err)
            await resp.write(sse({"error": {"message": err.message, "code": err.reason}}))
        finally:
            await keep.stop()
            await close_quietly(source)
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp

    def _opening(
        self, oa: OpenAiRequest, prep: Prepared, shaper: ChoiceLogprobs, msg: rpb.GenerateResponse, index: int
    ) -> bytes:
        """What a choice sends before its first token: chat's role, alone; completions' echoed prompt."""
        if oa.chat:
            opening = choice(oa, "", None, None, delta=True, first=True)
            opening["index"] = index
            chunk = envelope(oa, [opening], chunk=True)
            if oa.include_usage:
                chunk["usage"] = None
            return sse(chunk)
        if oa.echo:
            lp = self._echo_logprobs(shaper, prep, msg) if oa.logprobs else None
            return self._chunk(oa, self._prompt_text(prep), None, lp, index)
        return b""

    @classmethod
    def _tool_chunks(
        cls,
        oa: OpenAiRequest,
        events: list[ToolEvent],
        lp: dict[str, Any] | None,
        finish: str | None,
        calls: int,
        index: int,
    ) -> bytes:
        """A chunk per event of a tool-call answer (the logprobs of its tokens on the first), then at
        its end the finish reason ("tool_calls" when it made calls) in a chunk of its own."""
        chunks = []
        for event in events:
            one = choice(oa, "", None, lp, delta=True)
            one["delta"], lp = delta_of(event), None
            chunks.append(one)
        if finish:
            chunks.append(
                choice(oa, "", "tool_calls" if calls and finish == "stop" else finish, lp, delta=True)
            )
        out = b""
        for one in chunks:
            one["index"] = index
            chunk = envelope(oa, [one], chunk=True)
            if oa.include_usage:
                chunk["usage"] = None
            out += sse(chunk)
        return out

    @staticmethod
    def _chunk(
        oa: OpenAiRequest, text: str, finish: str | None, lp: dict[str, Any] | None, index: int
    ) -> bytes:
        one = choice(oa, text, finish, lp, delta=True)
        one["index"] = index
        chunk = envelope(oa, [one], chunk=True)
        if oa.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return sse(chunk)


def _joined(held: dict[str, Any] | None, more: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat logprobs of held tokens and the next ones, as one `{"content": [...]}`."""
    if held is None or more is None:
        return held or more
    return {"content": held["content"] + more["content"]}
