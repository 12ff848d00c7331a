"""SLOWLOG: the commands that took longer than ``slowlog-log-slower-than`` to run.

As Redis's: the time is the handler's own (not reading the request or
sending the reply), in microseconds; a threshold of 0 logs every command
and a negative one logs none; the newest ``slowlog-max-len`` entries are
kept. Each entry is (id, unix time, microseconds, arguments, client address,
client name), arguments shortened as Redis shortens them (32 at most, 128
bytes each). Dispatch measures every command; only a slow one costs more
than the comparison.
"""
from __future__ import annotations

import time
from collections import deque

from kvstore.net.protocol import writer
from kvstore.store.arena import Extent

MAX_ARGS = 32
MAX_ARG_BYTES = 128


class SlowLog:
    def __init__(self, slower_than_us: int, max_len: int):
        self.entries: deque = deque()
        self.next_id = 0
        self.configure(slower_than_us, max_len)

    def configure(self, slower_than_us: int, max_len: int) -> None:
        """New settings (CONFIG SET): the threshold in ns (infinite when negative) and the length."""
        self.threshold_ns = float("inf") if slower_than_us < 0 else slower_than_us * 1000
        self.max_len = max_len          # as Redis: applied at the next entry

    def record(self, conn, args: list, elapsed_ns: int) -> None:
        """Keep an entry for a command that ran ``elapsed_ns`` (at least the threshold)."""
        self.entries.appendleft((self.next_id, int(time.time()), elapsed_ns // 1000, _shortened(args),
                                 conn.addr, conn.client_info.name))
        self.next_id += 1
        while len(self.entries) > self.max_len:
            self.entries.pop()

    def reply(self, count: int) -> bytes:
        """SLOWLOG GET: the newest ``count`` entries (all when negative)."""
        chosen = list(self.entries) if count < 0 else list(self.entries)[:count]
        return writer.array([writer.array([writer.integer(i), writer.integer(when), writer.integer(us),
                                           writer.bulk_array(args), writer.bulk(addr), writer.bulk(name)])
                             for i, when, us, args, addr, name in chosen])


def _shortened(args: list) -> list[bytes]:
    if len(args) <= MAX_ARGS:
        return [_shown(arg) for arg in args]
    return [_shown(arg) for arg in args[:MAX_ARGS - 1]] + [b"... (%d more arguments)" % (len(args) - MAX_ARGS + 1)]


def _shown(arg) -> bytes:
    if isinstance(arg, Extent):     # a value received straight into the arena: its size only
        return b"... (%d more bytes)" % arg.size
    if len(arg) <= MAX_ARG_BYTES:
        return bytes(arg)
    return bytes(arg[:MAX_ARG_BYTES]) + b"... (%d more bytes)" % (len(arg) - MAX_ARG_BYTES)
