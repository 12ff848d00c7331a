"""Reading Mooncake-format request traces.

A trace is JSON Lines, one request a line: `timestamp` (ms since the start),
`input_length` and `output_length` (tokens) and `hash_ids`, the ids of the
prompt's 512-token blocks, already prefix-chained (two requests share id k at
position i exactly when they share the whole prefix up to block i). Bad input
is reported as a `TraceError` naming the line, never a traceback: a trace is
user input. Requests are returned sorted by arrival time as a list of small
records; the simulator never touches per-token data, only block ids.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the line."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_line(text: str, lineno: int, block_tokens: int = BLOCK_TOKENS) -> TraceRequest:
    """Parse and validate one trace line (``lineno`` is 1-based, for messages)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected a JSON object")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in obj:
            raise TraceError(f"line {lineno}: missing field '{name}'")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"line {lineno}: 'timestamp' must be a non-negative number")
    lengths = {}
    for name in ("input_length", "output_length"):
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TraceError(f"line {lineno}: '{name}' must be a positive integer")
        lengths[name] = value
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                            and h >= 0 for h in ids):
        raise TraceError(f"line {lineno}: 'hash_ids' must be a list of non-negative integers")
    expected = math.ceil(lengths["input_length"] / block_tokens)
    if len(ids) != expected:
        raise TraceError(f"line {lineno}: {len(ids)} hash_ids for input_length "
                         f"{lengths['input_length']} (expected {expected} blocks of "
                         f"{block_tokens} tokens)")
    return TraceRequest(ts / 1000.0, lengths["input_length"], lengths["output_length"],
                        tuple(ids))


def load_trace(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """All requests of a trace file, sorted by arrival; raises TraceError on bad input."""
    requests = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, text in enumerate(f, 1):
                if text.strip():
                    requests.append(parse_line(text, lineno, block_tokens))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is not UTF-8 text") from None
    if not requests:
        raise TraceError(f"trace {path} holds no requests")
    requests.sort(key=lambda r: r.arrival_s)
    return requests
