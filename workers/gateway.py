"""The OpenAI-compatible gateway's core: one request = a conductor decision, a prefill, a decode stream.

For `POST /v1/completions` and `/v1/chat/completions` (a chat's messages
rendered through the model's chat template) the gateway tokenizes the prompt,
asks the conductor where to run it (`Schedule`: a prefill and a decode
instance, and how many prefix tokens to reuse from the store), calls the
prefill worker, sends the first token at once (that is the TTFT), then relays
the decode worker's stream. A conductor rejection is HTTP 429 with its reason;
no instance, or a worker that cannot be reached before the first token, is 503
after one more `Schedule` (a prefill instance that cannot be reached is
reported to the conductor as unreachable first, so the retry and later
requests go elsewhere until that instance reports its own load again); a
decode worker lost is reported the same way, and its request ends with 503 or,
streaming, an error event. Every call carries a deadline, so nothing waits
forever on a dead process.

This module is the blocking part (`Router`, `complete`, `stream`), free of
HTTP; `workers.http_app` serves it over FastAPI and uvicorn.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import grpc

from proto import grpc_codegen
from workers import openai_api as api
from workers.metrics import GatewayMetrics
from workers.catalog import ByteTokenizer, encode

pb, pb_grpc = grpc_codegen.load("worker")
cpb, cpb_grpc = grpc_codegen.load("conductor")

log = logging.getLogger(__name__)
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
        """The prompt's token ids (a chat's rendered through the chat template); a chat without max_tokens
        gets the rest of the context as its max_tokens."""
        if req.chat:
            ids = self.chat_ids(req.messages)
        else:
            ids = req.prompt_ids if req.prompt_ids is not None else encode(self.tokenizer, req.prompt_text)
        if not ids:
            raise api.ApiError(400, "the prompt has no tokens", "prompt")
        if req.max_tokens is None:
            req.max_tokens = self.context_tokens - len(ids)
            if req.max_tokens <= 0:
                raise api.ApiError(400, f"the messages ({len(ids)} tokens) fill the model's context of "
                                   f"{self.context_tokens} tokens", "messages", "context_length_exceeded")
        if len(ids) + req.max_tokens > self.context_tokens:
            raise api.ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                               f"model's context of {self.context_tokens} tokens", "max_tokens",
                               "context_length_exceeded")
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The messages through the tokenizer's chat template with the assistant's turn opened; a tokenizer
        without one (the tiny model's bytes) gets ChatML, the format of SmolLM2's template."""
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
            except Exception as exc:        # jinja2's TemplateError: a template may refuse an order of roles
                raise api.ApiError(400, f"the chat template refused the messages: {exc}", "messages") from None
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return encode(self.tokenizer, text + "<|im_start|>assistant\n")

    def account(self, served: Served, completion_tokens: int) -> None:
        m = self.metrics
        m.count_request(200)
        m.add("prompt_tokens", served.prompt_tokens)
        m.add("completion_tokens", completion_tokens)
        m.add("prefix_tokens_reused", served.reused_tokens)

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


def complete(router: Router, req: api.CompletionRequest) -> dict:
    """A whole reply (blocking); ApiError for anything the client gets as an error."""
    ids = router.prompt_ids(req)
    served = Served(len(ids))
    tokens, finish = [], None
    timer = _Timer(router.metrics)
    try:
        for token, finish in router.generate(req, ids, served):
            timer.tick()
            tokens.append(token)
    except StreamBroken as exc:
        raise api.ApiError(503, str(exc), kind="service_unavailable") from None
    router.account(served, len(tokens))
    return api.completion_body(req, router.model, router.text(tokens), tokens, finish, len(ids))


def stream(router: Router, req: api.CompletionRequest) -> Iterator[bytes]:
    """A streamed reply's server-sent events (blocking). Until the first token every failure is an
    ApiError raised before the first event; a worker lost later is an error event, then `[DONE]`."""
    ids = router.prompt_ids(req)
    served = Served(len(ids))
    events = router.generate(req, ids, served)
    timer = _Timer(router.metrics)
    try:
        first = next(events)
        timer.tick()
        if req.chat:
            yield api.chunk(req, router.model, "", None, None, role=True)
        text, count, finish = IncrementalText(router), 0, None
        try:
            for i, (token, finish) in enumerate(_chain(first, events)):
                if i:
                    timer.tick()
                count += 1
                piece = text.add(token) + (text.rest() if finish is not None else "")
                usage = api.usage(len(ids), count) if finish is not None else None
                yield api.chunk(req, router.model, piece, token, finish, usage)
        except StreamBroken as exc:
            yield api.event(api.ApiError(503, str(exc), kind="service_unavailable").body())
        else:
            if req.include_usage:
                yield api.usage_chunk(req, router.model, api.usage(len(ids), count))
        yield api.DONE
        router.account(served, count)
    finally:
        events.close()
