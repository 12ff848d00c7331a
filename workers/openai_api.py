"""OpenAI `/v1/completions` bodies: parsing a request strictly, shaping replies, chunks and errors.

Every way a body can be wrong becomes an `ApiError` with an HTTP status and
OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`), raised
here at the edge so the gateway turns it into a reply in one place.
`temperature` 0 (or absent) is greedy decoding, the only mode served: the
workers promise output equal to a monolithic greedy run.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TOKENS = 16


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
    max_tokens: int
    stream: bool
    return_token_ids: bool
    request_id: str


def parse_completion(raw: bytes, model: str) -> CompletionRequest:
    """A validated request; ApiError(400) names the first thing wrong."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if "model" in body and body["model"] != model:
        raise ApiError(400, f"unknown model '{body['model']}'; this server serves '{model}'", "model",
                       "model_not_found")
    text, ids = _prompt(body.get("prompt"))
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not _is_int(max_tokens) or max_tokens <= 0:
        raise ApiError(400, "max_tokens must be a positive integer", "max_tokens")
    temperature = body.get("temperature", 0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature != 0:
        raise ApiError(400, "only greedy decoding is served: temperature must be 0", "temperature")
    for flag in ("stream", "return_token_ids"):
        if not isinstance(body.get(flag, False), bool):
            raise ApiError(400, f"{flag} must be true or false", flag)
    return CompletionRequest(text, ids, max_tokens, body.get("stream", False), body.get("return_token_ids", False),
                             f"cmpl-{uuid.uuid4().hex}")


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


def completion_body(req: CompletionRequest, model: str, text: str, tokens: list[int], finish: str,
                    prompt_tokens: int) -> dict:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if req.return_token_ids:
        choice["token_ids"] = tokens
    return {"id": req.request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, len(tokens))}


def chunk(req: CompletionRequest, model: str, text: str, token: int | None, finish: str | None,
          usage_: dict | None = None) -> bytes:
    """One server-sent event of a streamed completion."""
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if req.return_token_ids and token is not None:
        choice["token_ids"] = [token]
    body = {"id": req.request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
