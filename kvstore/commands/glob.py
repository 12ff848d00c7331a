"""Redis glob patterns (KEYS, SCAN MATCH, CONFIG GET, and key patterns of users).

Redis matches ``*``, ``?``, ``[...]`` classes (with ``^`` and ranges) and
backslash escapes byte by byte (util.c's stringmatchlen). We translate a
pattern to a compiled regex once (cached) and let the regex engine, which is
C, do the walk: a pattern that Redis would match with backtracking costs no
Python loop per key.
"""
from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=256)
def compile_pattern(pattern: bytes) -> re.Pattern:
    """Redis glob -> regex (``*``, ``?``, ``[...]`` with ``^`` and ranges, ``\\x``).

    Every token but ``*`` matches exactly one byte, so the stretches between
    stars have fixed lengths and the leftmost place each one fits is as good as
    any later one: each inner stretch is an atomic group (``(?>.*?seg)``) the
    regex engine never re-enters. Without that, ``a*a*a*...*b`` against a long
    run of ``a`` backtracks exponentially and stalls the node (Redis's own
    matcher bails out of such patterns too).
    """
    tokens, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i:i + 1]
        if c == b"*":
            if not tokens or tokens[-1] is not None:
                tokens.append(None)          # one star for a run of stars
        elif c == b"?":
            tokens.append(b".")
        elif c == b"\\" and i + 1 < n:
            i += 1
            tokens.append(re.escape(pattern[i:i + 1]))
        elif c == b"[":
            i, cls = _char_class(pattern, i + 1)
            tokens.append(cls)
        else:
            tokens.append(re.escape(c))
        i += 1
    segments, seg = [], []
    for tok in tokens:
        if tok is None:
            segments.append(b"".join(seg))
            seg = []
        else:
            seg.append(tok)
    segments.append(b"".join(seg))
    if len(segments) == 1:
        return re.compile(segments[0], re.DOTALL)
    inner = b"".join(b"(?>.*?" + s + b")" for s in segments[1:-1] if s)
    return re.compile(segments[0] + inner + b".*" + segments[-1], re.DOTALL)


def _char_class(pattern: bytes, i: int) -> tuple[int, bytes]:
    """Translate ``[...]`` starting after the ``[``; returns (index of ``]``, regex)."""
    negate = pattern[i:i + 1] == b"^"
    if negate:
        i += 1
    parts, n = [], len(pattern)
    while i < n and pattern[i:i + 1] != b"]":
        c = pattern[i:i + 1]
        if c == b"\\" and i + 1 < n:
            i += 1
            parts.append(re.escape(pattern[i:i + 1]))
        elif pattern[i + 1:i + 2] == b"-" and i + 2 < n:     # as Redis: "a-]" is a range
            lo, hi = sorted((pattern[i:i + 1], pattern[i + 2:i + 3]))
            parts.append(re.escape(lo) + b"-" + re.escape(hi))
            i += 2
        else:
            parts.append(re.escape(c))
        i += 1
    if not parts:
        return i, b"(?!)" if not negate else b"."
    return i, b"[" + (b"^" if negate else b"") + b"".join(parts) + b"]"


def matches(pattern: bytes | None, key: bytes) -> bool:
    return pattern is None or pattern == b"*" or compile_pattern(pattern).fullmatch(key) is not None
