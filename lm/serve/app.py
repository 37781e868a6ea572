"""The HTTP layer: OpenAI's routes on Starlette over a Scheduler; streams as server-sent events; every error as
OpenAI's JSON error object with its status, after which the server goes on serving.

    GET  /health                 {"status": "ok", "model", "slots", "busy", "waiting", "steps"}
    GET  /v1/models              the one model served; /v1/models/{name} that model's card
    POST /v1/completions         text completion (lm.serve.api.parse_completion)
    POST /v1/chat/completions    chat completion through the model's chat template

A request's rows go to the scheduler, whose thread hands their new text to the request's asyncio queue after
every step. A stream sends a chunk per piece of text as it becomes final (token by token), each choice's end
with its finish_reason, the usage if stream_options.include_usage asks, then `data: [DONE]`. A client that
disconnects (mid-stream, or while waiting for a whole response) cancels its request: its slots are free at the
next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lm.serve.api import APIError, Parsed, Reply, Served, parse_chat, parse_completion, parse_json
from lm.serve.scheduler import SHUTTING_DOWN, Request, Scheduler

STATUS_CLIENT_GONE = 499  # the response nobody reads (nginx's code; uvicorn drops it, access-log line and all)


def create_app(
    scheduler: Scheduler, served: Served, max_request_mb: float, on_ready: Callable[[], None] = lambda: None
) -> Starlette:
    """The app, refusing request bodies over `max_request_mb` MiB; `on_ready` is called once the server has started
    it, its signal handlers in place."""
    started = int(time.time())
    draining = asyncio.Event()  # set once the scheduler drains: a body still arriving then is answered too
    card = {"id": served.name, "object": "model", "created": started, "owned_by": "lm", "max_model_len": served.window}

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok", "model": served.name, **scheduler.load()})

    async def models(request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: HTTPRequest) -> Response:
        name = request.path_params["name"].removesuffix("/")  # (/v1/models/NAME/: a base URL's slash again)
        if not name:  # (/v1/models/, as a client's base_url with a trailing slash asks: the list)
            return await models(request)
        if name != served.name:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves `{served.name}`",
                "model",
                "model_not_found",
            )
        return JSONResponse(card)

    async def completions(request: HTTPRequest) -> Response:
        return await _generate(request, parse_completion)

    async def chat(request: HTTPRequest) -> Response:
        return await _generate(request, parse_chat)

    async def _generate(request: HTTPRequest, parse: Callable[[dict, Served], Parsed]) -> Response:
        try:
            body = await _unless_draining(_body(request, max_request_mb), draining)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            return Response(status_code=STATUS_CLIENT_GONE)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sink = lambda events, error: loop.call_soon_threadsafe(queue.put_nowait, (events, error))

        def parse_and_submit() -> tuple[Parsed, Request]:
            parsed = parse(parse_json(body), served)
            return parsed, scheduler.submit(parsed.choices, sink)

        # In a thread: parsing and tokenizing megabytes of prompt, and making a request's thousands of rows, would
        # hold every other request's steps back.
        parsed, ticket = await asyncio.to_thread(parse_and_submit)
        reply = Reply(parsed, served)
        if parsed.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(_stream(ticket, queue, reply), media_type="text/event-stream", headers=headers)
        return await _whole(request, ticket, queue, reply)

    routes = [Route("/health", health), Route("/health/", health), Route("/v1/models", models),
              Route("/v1/models/{name:path}", model)]  # fmt: skip
    for path, endpoint in (("/v1/completions", completions), ("/v1/chat/completions", chat)):
        # (with a trailing slash too, as a client may join its base URL: it was a 307 redirect without a body, which
        # a POST's client does not follow)
        routes += [Route(path, endpoint, methods=["POST"]), Route(path + "/", endpoint, methods=["POST"])]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}


    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loop = asyncio.get_running_loop()

        def drained() -> None:
            with contextlib.suppress(RuntimeError):  # (the loop has closed: nobody is left to answer)
                loop.call_soon_threadsafe(draining.set)

        scheduler.on_drain(drained)
        on_ready()
        yield

    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def _body(request: HTTPRequest, limit_mb: float) -> bytes:
    """The request's body, refused (413) once it is over `limit_mb` MiB: by its Content-Length before a byte is
    read, or as it arrives (a chunked one)."""
    limit = int(limit_mb * 2**20)
    too_large = APIError(  # (the limit as given: 0.001 was 0.000999451, the bytes it came to)
        413,
        f"the request body is over this server's limit of {limit_mb:g} MiB; send a shorter request, or start "
        "the server with a larger --max-request-mb",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise too_large
    return b"".join(chunks)


async def _unless_draining(reading: Awaitable[bytes], draining: asyncio.Event) -> bytes:
    """The body `reading` gives, unless the server drains first: a client still sending its body when the grace
    ends gets the 503 that the requests in progress get (uvicorn would cut it off later with a plain-text 500, a
    traceback in the log)."""
    body, drained = asyncio.ensure_future(reading), asyncio.ensure_future(draining.wait())
    try:
        done, _ = await asyncio.wait({body, drained}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        drained.cancel()
        if not body.done():
            body.cancel()
    if body not in done:
        raise _failure(SHUTTING_DOWN)
    return body.result()


async def _whole(request: HTTPRequest, ticket: Request, queue: asyncio.Queue, reply: Reply) -> Response:
    """The whole response once every choice has stopped; the request is cancelled if the client goes first."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while not reply.done:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return Response(status_code=STATUS_CLIENT_GONE)
            events, error = get.result()
            if error:
                raise _failure(error)
            reply.take(events)
        return JSONResponse(reply.body())
    finally:
        gone.cancel()
        if not reply.done:
            ticket.cancel()


async def _stream(ticket: Request, queue: asyncio.Queue, reply: Reply) -> AsyncIterator[str]:
    """The server-sent events of a stream. Starlette cancels this generator when the client disconnects."""
    try:
        while not reply.done:
            events, error = await queue.get()
            if error:
                yield _event(_failure(error).body())
                break
            for chunk in reply.take(events):
                yield _event(chunk)
        else:
            if reply.parsed.include_usage:
                yield _event(reply.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:
        if not reply.done:
            ticket.cancel()


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client disconnects (the request's body has been read: nothing else arrives before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _failure(error: str) -> APIError:
    """The scheduler's error for a request: 503 when the server is shutting down (try again), else 500."""
    return APIError(503 if error == SHUTTING_DOWN else 500, error)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _api_error(request: HTTPRequest, e: Exception) -> Response:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: HTTPRequest, e: Exception) -> Response:
    path = request.url.path
    messages = {404: f"no route {path}", 405: f"{request.method} is not allowed on {path}"}
    if path.rstrip("/") in ("/completions", "/chat/completions", "/models") or path.startswith("/models/"):
        # (OpenAI(base_url="http://HOST:PORT") leaves out the /v1 that OpenAI's own base URL ends in)
        messages[404] += f"; the API is under /v1 ({request.method} /v1{path}): end the client's base_url in /v1"
    error = APIError(e.status_code, messages.get(e.status_code, str(e.detail)), kind="invalid_request_error")
    return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))


async def _server_error(request: HTTPRequest, e: Exception) -> Response:
    # Starlette raises the exception again after this response, so the server's log has its traceback.
    return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)
