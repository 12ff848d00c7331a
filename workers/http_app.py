"""The gateway's HTTP layer: FastAPI routes over a `Router`, served by uvicorn (as vLLM and SGLang serve theirs).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`/health` and Prometheus `/metrics`. Bodies are read here and parsed by
`workers.openai_api`; the blocking work (tokenizing, the conductor, the workers'
gRPC calls) runs on threads: a whole reply on a pool thread, a stream on a
thread of its own that hands each event to the event loop, so a slow request
never holds the loop. Every error is OpenAI's error object; unknown routes are
404.

Slow or stalled clients cost nothing but a socket, and not forever: a request
head or body that stays silent for `CLIENT_TIMEOUT_S` ends the connection
(408 for a body), as does a stream the client stops reading; a stream whose
client disconnects stops its decode at the next token. Bodies are capped at
`MAX_BODY_BYTES` (413).
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Iterator

import anyio
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from workers import openai_api as api
from workers.gateway import Router, complete, stream

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
CLIENT_TIMEOUT_S = 60.0
SHUTDOWN_GRACE_S = 2        # in-flight requests get this long when the gateway stops
MAX_THREADS = 512           # whole (non-streamed) replies computed at once


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvstore gateway", docs_url=None, redoc_url=None, openapi_url=None)
    threads = anyio.CapacityLimiter(MAX_THREADS)

    @app.exception_handler(api.ApiError)
    async def api_error(request: Request, exc: api.ApiError) -> Response:
        router.metrics.count_request(exc.status)
        close = {"Connection": "close"} if exc.status in (408, 413) else None    # the rest of the body is unread
        return _json(exc.status, exc.body(), close)

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException) -> Response:
        return await api_error(request, api.ApiError(404, f"no route for {request.method} {request.url.path}",
                                                     kind="not_found"))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> Response:
        return await api_error(request, api.ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                     kind="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        return _json(200, {"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(200, {"object": "list", "data": [{"id": router.model, "object": "model",
                                                       "created": 0, "owned_by": "kvstore"}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render().encode(), media_type="text/plain; version=0.0.4")

    async def serve(req: api.CompletionRequest) -> Response:
        if not req.stream:
            return _json(200, await anyio.to_thread.run_sync(complete, router, req, limiter=threads))
        relay = Relay(stream(router, req))
        first = await relay.next()          # an ApiError here is still a proper HTTP error reply
        return EventStream(relay, first)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(api.parse_completion(await _body(request), router.model))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(api.parse_chat(await _body(request), router.model))

    return app


def _json(status: int, body: dict, headers: dict | None = None) -> Response:
    return Response(json.dumps(body).encode(), status, headers, media_type="application/json")


async def _body(request: Request) -> bytes:
    """The whole body, at most MAX_BODY_BYTES, each read within CLIENT_TIMEOUT_S."""
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        raise api.ApiError(400, "the Content-Length is not a number")
    if length is not None and int(length) > MAX_BODY_BYTES:
        raise api.ApiError(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
    parts, size, more = [], 0, True
    while more:
        try:
            message = await asyncio.wait_for(request.receive(), CLIENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise api.ApiError(408, f"the client sent nothing for {CLIENT_TIMEOUT_S:g} s", kind="timeout") from None
        if message["type"] == "http.disconnect":
            raise api.ApiError(400, "the client went away while sending its body")
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > MAX_BODY_BYTES:
            raise api.ApiError(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
        more = message.get("more_body", False)
    return b"".join(parts)


_END = object()


class Relay:
    """Runs a blocking iterator of events on a thread of its own; the event loop awaits them with `next`.
    `stop` makes the thread close the iterator after the event it is waiting for (that cancels the decode)."""

    def __init__(self, events: Iterator[bytes]):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stopping = threading.Event()
        threading.Thread(target=self._run, args=(events,), name="stream", daemon=True).start()

    def _run(self, events: Iterator[bytes]) -> None:
        try:
            for item in events:
                self._put(item)
                if self._stopping.is_set():
                    break
        except BaseException as exc:        # handed to the loop, which raises it
            self._put(exc)
        finally:
            events.close()
            self._put(_END)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:                # the loop has closed: the server stopped
            self._stopping.set()

    async def next(self) -> bytes | None:
        """The next event; None at the end; the iterator's exception, raised."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is _END else item

    def stop(self) -> None:
        self._stopping.set()


class EventStream(StreamingResponse):
    """`text/event-stream` of a relay's events: dropped when the client disconnects or stops reading."""

    def __init__(self, relay: Relay, first: bytes | None):
        super().__init__(iter(()), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.relay, self.first = relay, first

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            event = self.first
            while event is not None and not gone.done():
                await asyncio.wait_for(send({"type": "http.response.body", "body": event, "more_body": True}),
                                       CLIENT_TIMEOUT_S)
                event = await self.relay.next()
            if not gone.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.TimeoutError:         # uvicorn closes a connection whose response never completed
            log.warning("a client stopped reading its stream for %g s; dropped", CLIENT_TIMEOUT_S)
        finally:
            self.relay.stop()
            gone.cancel()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Http(H11Protocol):
    """uvicorn's h11 protocol, also timing the request head: uvicorn times only the wait between requests,
    so a client that connects and stalls before a whole head would hold its connection forever."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._time_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._time_head()           # still no whole request head

    def _time_head(self) -> None:
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(CLIENT_TIMEOUT_S, self.timeout_keep_alive_handler)


class GatewayServer:
    """uvicorn serving `create_app(router)` on HOST:PORT from a thread: `start()`, `url`, `stop()`.
    The socket is bound here, so a port in use is an OSError at construction and port 0 is known at once."""

    def __init__(self, router: Router, host: str, port: int):
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(router), http=_Http, ws="none", lifespan="off", log_config=None, access_log=False,
            timeout_keep_alive=CLIENT_TIMEOUT_S, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> GatewayServer:
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server exited while starting")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(SHUTDOWN_GRACE_S + 5)
        self.sock.close()


def make_server(router: Router, host: str, port: int) -> GatewayServer:
    return GatewayServer(router, host, port)
