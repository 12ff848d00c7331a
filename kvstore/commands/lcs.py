"""LCS: the longest common subsequence of two string values, as Redis 7 computes it.

The table of prefix lengths is built a row at a time with numpy (a row is
a running maximum over the previous one), then walked back from the end the
way Redis walks it, so the string, the length and the IDX ranges (and their
order) are Redis's. The table is as big as Redis's and refused past the same
bound (proto-max-bulk-len), so a client cannot make it grow without limit;
the walk back is a Python loop over both values, so the string and IDX
replies are refused for values longer than ``MAX_WALK`` together (LEN, which
needs no walk, is not).
"""
from __future__ import annotations

import numpy as np

from kvstore.commands.args import SYNTAX, parse_int
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer

FAMILY = Family()

_LCS_OPTIONS = {b"IDX", b"LEN", b"WITHMATCHLEN"}
MAX_WALK = 256 * 1024       # bytes of both values together that the string and IDX replies walk back over


def _options(args: list) -> tuple[bool, bool, bool, int]:
    get_len = get_idx = with_len = False
    min_len, i = 0, 3
    while i < len(args):
        opt = args[i].upper()
        if opt == b"MINMATCHLEN" and i + 1 < len(args):
            min_len = max(0, parse_int(args[i + 1]))
            i += 1
        elif opt not in _LCS_OPTIONS:
            raise CommandError(SYNTAX)
        get_idx, get_len, with_len = get_idx or opt == b"IDX", get_len or opt == b"LEN", \
            with_len or opt == b"WITHMATCHLEN"
        i += 1
    if get_idx and get_len:
        raise CommandError("If you want both the length and indexes, please just use IDX.")
    return get_len, get_idx, with_len, min_len


def _table(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """table[i, j]: the LCS length of a[:i] and b[:j]; one numpy step per byte of the shorter
    value (at most the square root of the table's bound), never a Python loop over the longer."""
    if len(a) > len(b):
        return _table(b, a).T
    table = np.zeros((len(a) + 1, len(b) + 1), dtype=np.uint32)
    for i in range(1, len(a) + 1):
        above = table[i - 1]
        candidate = np.where(b == a[i - 1], above[:-1] + 1, above[1:])
        np.maximum.accumulate(candidate, out=table[i, 1:])
    return table


@FAMILY.command("LCS", -3, "readonly", "string", "Finds the longest common substring.", keys=(1, 2, 1),
         reads=lambda conn, args: args[1:3])
def lcs(conn, args):
    get_len, get_idx, with_len, min_len = _options(args)
    values = []
    for key in args[1:3]:
        entry = conn.engine.lookup(key)
        values.append(b"" if entry is None else conn.engine.value(entry))
    a, b = (np.frombuffer(v, dtype=np.uint8) for v in values)
    if (len(a) + 1) * (len(b) + 1) * 4 > conn.server.config.proto_max_bulk_len:
        raise CommandError("Insufficient memory, transient memory for LCS exceeds proto-max-bulk-len")
    table = _table(a, b)
    total = int(table[len(a), len(b)])
    if get_len:
        return writer.integer(total)
    if len(a) + len(b) > MAX_WALK:
        raise CommandError(f"LCS walks back over both values one byte at a time: longer than {MAX_WALK} bytes "
                           "together they would stall the node (LEN still answers)")
    text, ranges = _walk_back(values[0], values[1], table, min_len)
    if not get_idx:
        return writer.bulk(text)
    matches = [writer.array([writer.array([writer.integer(s), writer.integer(e)]) for s, e in (ra, rb)]
                            + ([writer.integer(ra[1] - ra[0] + 1)] if with_len else []))
               for ra, rb in ranges]
    return conn.enc.map([(writer.bulk(b"matches"), writer.array(matches)), (writer.bulk(b"len"), writer.integer(total))])


def _walk_back(a: bytes, b: bytes, table: np.ndarray, min_len: int) -> tuple[bytes, list]:
    """The common subsequence and its matching ranges, from the end, as Redis's lcsCommand."""
    i, j, out, ranges = len(a), len(b), bytearray(), []
    start = None            # [a_start, a_end, b_start, b_end] of the range being grown backward
    while i > 0 and j > 0:
        emit = False
        if a[i - 1] == b[j - 1]:
            out.append(a[i - 1])
            if start is None:
                start = [i - 1, i - 1, j - 1, j - 1]
            else:
                start[0], start[2] = start[0] - 1, start[2] - 1
            emit = start[0] == 0 or start[2] == 0
            i, j = i - 1, j - 1
        else:
            if table[i - 1, j] > table[i, j - 1]:
                i -= 1
            else:
                j -= 1
            emit = start is not None
        if emit:
            if start[1] - start[0] + 1 >= min_len:
                ranges.append(((start[0], start[1]), (start[2], start[3])))
            start = None
    return bytes(reversed(out)), ranges
