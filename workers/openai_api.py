"""OpenAI `/v1/completions` and `/v1/chat/completions` bodies: strict parsing, and the replies' shapes.

Every way a body can be wrong becomes an `ApiError` with an HTTP status and
OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`), raised
here at the edge so the gateway turns it into a reply in one place.
`temperature` 0 (or absent) is greedy decoding, the only mode served: the
workers promise output equal to a monolithic greedy run.

A chat request carries its messages (role and text; content parts of type
`text` are joined); the gateway renders them through the model's chat
template. Without `max_tokens` (or `max_completion_tokens`) a chat may use the
rest of the model's context, as vLLM's does; a completion gets 16 tokens, as
OpenAI's legacy endpoint does. Streams follow OpenAI: chunks of
`text_completion` or `chat.completion.chunk` (the first chat chunk names the
role), `stream_options.include_usage` adds a last chunk with no choices and the
usage, and `data: [DONE]` ends the stream.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class CompletionRequest:
    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int | None               # None: the rest of the context (chat only)
    stream: bool
    return_token_ids: bool
    request_id: str
    messages: list[dict] | None = None   # a chat: [{"role", "content"}], content as text
    include_usage: bool = False

    @property
    def chat(self) -> bool:
        return self.messages is not None


def parse_completion(raw: bytes, model: str) -> CompletionRequest:
    """A validated `/v1/completions` request; ApiError(400) names the first thing wrong."""
    body = _object(raw, model)
    text, ids = _prompt(body.get("prompt"))
    max_tokens = _max_tokens(body, ("max_tokens",), DEFAULT_MAX_TOKENS)
    stream, include_usage, token_ids = _sampling_and_stream(body)
    return CompletionRequest(text, ids, max_tokens, stream, token_ids, f"cmpl-{uuid.uuid4().hex}",
                             include_usage=include_usage)


def parse_chat(raw: bytes, model: str) -> CompletionRequest:
    """A validated `/v1/chat/completions` request; ApiError(400) names the first thing wrong."""
    body = _object(raw, model)
    messages = _messages(body.get("messages"))
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    stream, include_usage, token_ids = _sampling_and_stream(body)
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one choice per request is served", "n")
    if body.get("stop"):
        raise ApiError(400, "stop sequences are not served", "stop")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools are not served", "tools")
    if body.get("logprobs"):
        raise ApiError(400, "logprobs are not served", "logprobs")
    return CompletionRequest(None, None, max_tokens, stream, token_ids, f"chatcmpl-{uuid.uuid4().hex}",
                             messages, include_usage)


def _object(raw: bytes, model: str) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if "model" in body and body["model"] != model:
        raise ApiError(400, f"unknown model '{body['model']}'; this server serves '{model}'", "model",
                       "model_not_found")
    return body


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = body.get(name)
        if value is not None:
            if not _is_int(value) or value <= 0:
                raise ApiError(400, f"{name} must be a positive integer", name)
            return value
    return default


def _sampling_and_stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, return_token_ids), after checking the sampling the body asks for."""
    temperature = body.get("temperature", 0)
    if temperature is None:
        temperature = 0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature != 0:
        raise ApiError(400, "only greedy decoding is served: temperature must be 0", "temperature")
    for flag in ("stream", "return_token_ids"):
        if not isinstance(body.get(flag, False), bool):
            raise ApiError(400, f"{flag} must be true or false", flag)
    stream, options = body.get("stream", False), body.get("stream_options")
    if options is None:
        return stream, False, body.get("return_token_ids", False)
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "stream_options must be an object whose include_usage is true or false",
                       "stream_options")
    return stream, options.get("include_usage", False), body.get("return_token_ids", False)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """A string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) and 0 <= t < 2**32 for t in prompt):
        return None, list(prompt)
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                   "prompt")


def _messages(messages: Any) -> list[dict]:
    """[{"role", "content"}] with content as text; `developer` is served as `system`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with a role and a content", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}"
                           + (" (tools are not served)" if role in ("tool", "function") else ""), f"{where}.role")
        if message.get("tool_calls") or message.get("function_call"):
            raise ApiError(400, f"{where}: tool calls are not served", f"{where}.tool_calls")
        if "name" in message and not isinstance(message["name"], str):
            raise ApiError(400, f"{where}.name must be a string", f"{where}.name")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(message.get("content"), f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    """A string, or a list of `{"type": "text", "text": ...}` parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are served",
                               where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a non-empty list of text parts", where)


def completion_body(req: CompletionRequest, model: str, text: str, tokens: list[int], finish: str,
                    prompt_tokens: int) -> dict:
    """The whole reply: a `text_completion`, or a `chat.completion` for a chat."""
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if req.return_token_ids:
        choice["token_ids"] = tokens
    return {**_head(req, model, "chat.completion" if req.chat else "text_completion"), "choices": [choice],
            "usage": usage(prompt_tokens, len(tokens))}


def chunk(req: CompletionRequest, model: str, text: str, token: int | None, finish: str | None,
          usage_: dict | None = None, role: bool = False) -> bytes:
    """One server-sent event of a streamed reply: a token's text (`delta` for a chat; with the role when
    `role`). A completion's last token chunk carries the usage unless the client asked for a usage chunk."""
    if req.chat:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if req.return_token_ids and token is not None:
        choice["token_ids"] = [token]
    body = {**_head(req, model, "chat.completion.chunk" if req.chat else "text_completion"), "choices": [choice]}
    if req.include_usage:
        body["usage"] = None
    elif usage_ is not None and not req.chat:
        body["usage"] = usage_
    return event(body)


def usage_chunk(req: CompletionRequest, model: str, usage_: dict) -> bytes:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return event({**_head(req, model, "chat.completion.chunk" if req.chat else "text_completion"),
                  "choices": [], "usage": usage_})


def _head(req: CompletionRequest, model: str, kind: str) -> dict:
    return {"id": req.request_id, "object": kind, "created": int(time.time()), "model": model}


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
