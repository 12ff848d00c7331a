"""The OpenAI-compatible HTTP gateway: one request = a conductor decision, a prefill, a decode stream.

For `POST /v1/completions` the gateway tokenizes the prompt, asks the conductor
where to run it (`Schedule`: a prefill and a decode instance, and how many
prefix tokens to reuse from the store), calls the prefill worker, sends the
first token at once (that is the TTFT), then relays the decode worker's stream.
A conductor rejection is HTTP 429 with its reason; no instance, or a worker
that cannot be reached before the first token, is 503 after one more
`Schedule` (a prefill instance that cannot be reached is reported to the
conductor as unreachable first, so the retry and later requests go elsewhere
until that instance reports its own load again); a decode worker lost is
reported the same way, and its request ends with 503 or, streaming, an error
event. Every call carries a deadline, so nothing waits
forever on a dead process.

`GET /v1/models`, `/health` and Prometheus `/metrics` (TTFT and TBT histograms,
prefix tokens reused) complete the surface. The server is the standard
library's threaded HTTP server: one thread per connection, bodies capped at
`MAX_BODY_BYTES`, a client silent for `CLIENT_TIMEOUT_S` dropped.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import grpc

from proto import grpc_codegen
from workers import openai_api as api
from workers.metrics import GatewayMetrics
from workers.catalog import ByteTokenizer, encode

pb, pb_grpc = grpc_codegen.load("worker")
cpb, cpb_grpc = grpc_codegen.load("conductor")

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
CLIENT_TIMEOUT_S = 60.0
SCHEDULE_TIMEOUT_S = 10.0
PREFILL_TIMEOUT_S = 300.0
DECODE_TIMEOUT_S = 900.0
SCHEDULE_TRIES = 2


class StreamBroken(Exception):
    """A worker failed after tokens were already sent."""


@dataclass
class Served:
    """What the conductor and prefill said about a request, for metrics and the usage block."""

    prompt_tokens: int
    reused_tokens: int = 0
    recomputed: bool = False


class Router:
    """Runs one completion through the conductor, a prefill worker and a decode worker."""

    def __init__(self, conductor: str, model: str, tokenizer: Any, context_tokens: int, eos_token_id: int | None,
                 metrics: GatewayMetrics):
        self.model, self.tokenizer, self.context_tokens = model, tokenizer, context_tokens
        self.eos_token_id = eos_token_id
        self.metrics = metrics
        self.conductor = cpb_grpc.ConductorStub(grpc.insecure_channel(conductor))
        self._stubs: dict[str, Any] = {}
        self._lock = threading.Lock()

    def prompt_ids(self, req: api.CompletionRequest) -> list[int]:
        ids = req.prompt_ids if req.prompt_ids is not None else encode(self.tokenizer, req.prompt_text)
        if not ids:
            raise api.ApiError(400, "the prompt has no tokens", "prompt")
        if len(ids) + req.max_tokens > self.context_tokens:
            raise api.ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                               f"model's context of {self.context_tokens} tokens", "max_tokens",
                               "context_length_exceeded")
        return ids

    def text(self, tokens: list[int]) -> str:
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.decode(tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def generate(self, req: api.CompletionRequest, ids: list[int], served: Served) -> Iterator[tuple[int, str | None]]:
        """(token, finish reason or None), first token included; ApiError before the first token."""
        decision, first = self._prefill(req, ids, served)
        finish = self._finish(first, 1, req.max_tokens)
        yield first.first_token, finish
        if finish is not None:
            return
        decode = self._stub(decision.decode_address).Decode(pb.DecodeRequest(
            request_id=req.request_id, token_ids=ids, first_token=first.first_token,
            stored_tokens=first.stored_tokens, max_tokens=req.max_tokens), timeout=DECODE_TIMEOUT_S)
        try:
            for token in decode:
                served.recomputed = served.recomputed or token.recomputed
                yield token.token, token.finish_reason or None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._report_unreachable(decision.decode_instance)
            raise StreamBroken(f"decode worker {decision.decode_instance}: {exc.details()}") from None
        finally:
            decode.cancel()

    def _prefill(self, req: api.CompletionRequest, ids: list[int], served: Served):
        """Schedule and prefill, with one more Schedule when the chosen worker cannot be reached."""
        error = None
        for _ in range(SCHEDULE_TRIES):
            decision = self._schedule(req, ids)
            served.reused_tokens = decision.reused_tokens
            try:
                first = self._stub(decision.prefill_address).Prefill(pb.PrefillRequest(
                    request_id=req.request_id, token_ids=ids, reuse_tokens=decision.reused_tokens),
                    timeout=PREFILL_TIMEOUT_S)
                return decision, first
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise api.ApiError(400, exc.details()) from None
                error = f"prefill worker {decision.prefill_instance}: {exc.code().name} {exc.details()}"
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._report_unreachable(decision.prefill_instance)
        raise api.ApiError(503, error, kind="service_unavailable")

    def _report_unreachable(self, instance_id: str) -> None:
        """Tell the conductor this instance is unreachable, so the next Schedule looks elsewhere;
        the instance's own next load report (if it comes back) takes it back."""
        try:
            self.conductor.ReportLoad(cpb.LoadReport(instance_id=instance_id, unreachable=True),
                                      timeout=SCHEDULE_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.debug("could not report %s as unreachable: %s", instance_id, exc)

    def _schedule(self, req: api.CompletionRequest, ids: list[int]):
        try:
            decision = self.conductor.Schedule(cpb.ScheduleRequest(
                request_id=req.request_id, token_ids=ids, output_length=req.max_tokens), timeout=SCHEDULE_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise api.ApiError(429, exc.details(), kind="rate_limit_exceeded") from None
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise api.ApiError(400, exc.details()) from None
            raise api.ApiError(503, f"conductor: {exc.code().name} {exc.details()}", kind="service_unavailable") \
                from None
        if not decision.prefill_address or not decision.decode_address:
            raise api.ApiError(503, "the conductor named an instance without an address", kind="service_unavailable")
        return decision

    def _finish(self, reply, produced: int, max_tokens: int) -> str | None:
        if self.eos_token_id is not None and reply.first_token == self.eos_token_id:
            return "stop"
        return "length" if produced >= max_tokens else None

    def _stub(self, address: str):
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = pb_grpc.WorkerStub(grpc.insecure_channel(address))
            return stub


class IncrementalText:
    """Text of a growing token list, released only once it no longer ends mid-character."""

    def __init__(self, router: Router):
        self.router, self.tokens, self.sent = router, [], 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.router.text(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def rest(self) -> str:
        text = self.router.text(self.tokens)
        piece, self.sent = text[self.sent:], len(text)
        return piece


class GatewayHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT_S          # a client that stalls mid-request is dropped, not waited on forever
    router: Router                      # set on the subclass the server is built with

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.router.model, "object": "model",
                                                         "owned_by": "kvstore"}]})
        elif self.path == "/metrics":
            self._send(200, self.router.metrics.render().encode(), "text/plain; version=0.0.4")
        else:
            self._error(api.ApiError(404, f"no route for GET {self.path}", kind="not_found"))

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._error(api.ApiError(404, f"no route for POST {self.path}", kind="not_found"))
            return
        try:
            req = api.parse_completion(self._body(), self.router.model)
            ids = self.router.prompt_ids(req)
            (self._stream if req.stream else self._complete)(req, ids)
        except api.ApiError as exc:
            self._error(exc)

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise api.ApiError(400, "a JSON body with a Content-Length is required")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise api.ApiError(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
        return self.rfile.read(int(length))

    def _complete(self, req: api.CompletionRequest, ids: list[int]) -> None:
        served = Served(len(ids))
        tokens, finish = [], None
        timer = _Timer(self.router.metrics)
        try:
            for token, finish in self.router.generate(req, ids, served):
                timer.tick()
                tokens.append(token)
        except StreamBroken as exc:
            raise api.ApiError(503, str(exc), kind="service_unavailable") from None
        self._account(served, len(tokens))
        self._json(200, api.completion_body(req, self.router.model, self.router.text(tokens), tokens, finish,
                                            len(ids)))

    def _stream(self, req: api.CompletionRequest, ids: list[int]) -> None:
        served = Served(len(ids))
        events = self.router.generate(req, ids, served)
        timer = _Timer(self.router.metrics)
        first = next(events)            # an ApiError here is still a proper HTTP error reply
        timer.tick()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        text, count = IncrementalText(self.router), 0
        try:
            for i, (token, finish) in enumerate(_chain(first, events)):
                if i:
                    timer.tick()
                count += 1
                piece = text.add(token) + (text.rest() if finish is not None else "")
                usage = api.usage(len(ids), count) if finish is not None else None
                self.wfile.write(api.chunk(req, self.router.model, piece, token, finish, usage))
                self.wfile.flush()
        except StreamBroken as exc:
            self.wfile.write(b"data: " + json.dumps(api.ApiError(503, str(exc)).body()).encode() + b"\n\n")
        except (BrokenPipeError, ConnectionResetError):
            events.close()
            return
        self.wfile.write(api.DONE)
        self.wfile.flush()
        self._account(served, count)

    def _account(self, served: Served, completion_tokens: int) -> None:
        m = self.router.metrics
        m.count_request(200)
        m.add("prompt_tokens", served.prompt_tokens)
        m.add("completion_tokens", completion_tokens)
        m.add("prefix_tokens_reused", served.reused_tokens)

    def _error(self, exc: api.ApiError) -> None:
        self.router.metrics.count_request(exc.status)
        self._json(exc.status, exc.body())

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _chain(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest


class _Timer:
    """TTFT at the first tick, TBT between later ones."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics, self.started, self.last = metrics, time.perf_counter(), None

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.observe_ttft(now - self.started)
        else:
            self.metrics.observe_tbt(now - self.last)
        self.last = now


def make_server(router: Router, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (GatewayHandler,), {"router": router})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
