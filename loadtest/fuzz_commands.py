"""Fuzz every command of the command table against a live node; the node must survive.

    python -m loadtest.fuzz_commands [--commands 100000] [--seed N] [--host H --port P]

Hypothesis draws pipelines of requests from `command_grammar` (right and
wrong arities, boundary integers, huge counts, binary keys, values up to
1 MiB) and each pipeline is sent in one write to a `kvstore serve` this script
starts (or to --host/--port). Checked after every pipeline:

- every reply is well-formed RESP2/RESP3, parsed strictly (lengths, CRLFs,
  integer syntax, an error code in capitals), one reply per request;
- no reply is the node's "internal error" (a handler that raised);
- the node's process is alive and answers PING on a second connection;
- the connection closes only where a request says it may (QUIT, ACL DELUSER).

At the end it prints the node's RSS (INFO used_memory_rss) after the first
tenth of the commands and at the end: the growth must stay within
--max-rss-growth-mb (50 by default). A failure prints the pipeline that
caused it and the tail of the node's log, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import re
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from loadtest.command_grammar import batches, entries, entry_name, request
from loadtest.procs import HOST, ProcessGroup, start_kvstore

INTERNAL_ERROR = b"-ERR internal error"
ROUND = 500                        # pipelines per hypothesis run
CLOSERS = (b"QUIT", b"ACL")        # requests after which the node may close the connection
_INTEGER = re.compile(rb"-?\d+\Z")


class BadReply(AssertionError):
    """The node broke the protocol, the connection, or died."""


class Incomplete(Exception):
    """More bytes are needed for the reply."""


def reply_end(buf: bytes, pos: int = 0) -> int:
    """Where the RESP2/RESP3 reply at ``pos`` ends; BadReply when it is not well formed."""
    eol = buf.find(b"\r\n", pos)
    if eol < 0:
        raise Incomplete
    kind, line = buf[pos:pos + 1], buf[pos + 1:eol]
    if kind in (b"+", b"-"):
        if b"\r" in line or b"\n" in line or (kind == b"-" and not re.match(rb"[A-Z]+ ", line + b" ")):
            raise BadReply(f"bad status or error line {line[:80]!r}")
        return eol + 2
    if kind in (b":", b"("):
        return _checked(eol + 2, bool(_INTEGER.match(line)), line)
    if kind == b",":
        return _checked(eol + 2, bool(re.match(rb"-?(\d+(\.\d+)?(e[-+]?\d+)?|inf|nan)\Z", line)), line)
    if kind == b"#":
        return _checked(eol + 2, line in (b"t", b"f"), line)
    if kind == b"_":
        return _checked(eol + 2, line == b"", line)
    if not _INTEGER.match(line):
        raise BadReply(f"bad length {line[:80]!r} for {kind!r}")
    count = int(line)
    if kind in (b"$", b"!", b"="):
        return _bulk_end(buf, eol + 2, count, kind)
    if kind in (b"*", b"~", b">", b"%", b"|"):
        if count < -1 or (count == -1 and kind != b"*"):
            raise BadReply(f"bad count {count} for {kind!r}")
        pos = eol + 2
        for _ in range(max(count, 0) * (2 if kind in (b"%", b"|") else 1)):
            pos = reply_end(buf, pos)
        return reply_end(buf, pos) if kind == b"|" else pos
    raise BadReply(f"unknown reply type {kind!r}")


def _checked(end: int, ok: bool, line: bytes) -> int:
    if not ok:
        raise BadReply(f"malformed scalar {line[:80]!r}")
    return end


def _bulk_end(buf: bytes, start: int, size: int, kind: bytes) -> int:
    if size == -1 and kind == b"$":
        return start
    if size < 0:
        raise BadReply(f"bad bulk length {size}")
    if len(buf) < start + size + 2:
        raise Incomplete
    if buf[start + size:start + size + 2] != b"\r\n":
        raise BadReply("bulk not followed by CRLF")
    return start + size + 2


def encode(args: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


@dataclass
class Tally:
    """What the run sent and what came back."""

    commands: int = 0
    pipelines: int = 0
    errors: Counter = field(default_factory=Counter)      # error code -> replies
    sent: Counter = field(default_factory=Counter)        # command or container|sub -> requests
    closes: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        rate = self.commands / max(time.monotonic() - self.started, 1e-9)
        top = ", ".join(f"{code} {n}" for code, n in self.errors.most_common(6))
        return (f"{self.commands} commands in {self.pipelines} pipelines ({rate:.0f}/s), "
                f"{sum(self.errors.values())} error replies ({top}), {self.closes} closes by request")


class Session:
    """The fuzzer's connection to the node, and its checks."""

    def __init__(self, host: str, port: int, alive=lambda: True, timeout: float = 30.0):
        self.host, self.port, self.alive, self.timeout = host, port, alive, timeout
        self.tally = Tally()
        self.sock: socket.socket | None = None
        self.token = self._arena_token()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _arena_token(self) -> bytes:
        """The node's arena token (KV.ARENA's fifth field), so fast-path requests pass its check."""
        with self._connect() as sock:
            sock.sendall(encode([b"KV.ARENA"]))
            reply = _read_replies(sock, 1)[0]
        if not reply.startswith(b"*"):
            return b""
        pos = reply.index(b"\r\n") + 2
        for _ in range(4):                  # size, pid, fd, token offset
            pos = reply_end(reply, pos)
        size_end = reply.index(b"\r\n", pos)
        return reply[size_end + 2:reply_end(reply, pos) - 2]

    def run(self, pipeline: list[list[bytes]]) -> None:
        """Send the pipeline in parts that end where the node may close; check every reply."""
        part: list[list[bytes]] = []
        for request in pipeline:
            part.append(request)
            if request[0].upper() in CLOSERS:
                self._run_part(part, may_close=True)
                part = []
        if part:
            self._run_part(part, may_close=False)
        self.tally.pipelines += 1
        self._check_alive(pipeline)

    def _run_part(self, part: list[list[bytes]], may_close: bool) -> None:
        if self.sock is None:
            self.sock = self._connect()
        self.sock.sendall(b"".join(encode(r) for r in part))
        try:
            replies = _read_replies(self.sock, len(part))
        except ConnectionError as exc:
            self._drop()
            if not may_close:
                raise BadReply(f"the node closed the connection: {exc}; pipeline: {_short(part)}") from None
            self.tally.closes += 1
            return
        self.tally.commands += len(part)
        self.tally.sent.update(entry_name(request) for request in part)
        for request, reply in zip(part, replies):
            if reply.startswith(INTERNAL_ERROR):
                raise BadReply(f"internal error for {_short([request])}")
            if reply[:1] in (b"-", b"!"):
                self.tally.errors[reply[1:].split(b" ", 1)[0].decode(errors="replace")] += 1
        if may_close:
            self._drop()            # start the next part on a fresh connection as the default user

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _check_alive(self, pipeline) -> None:
        if not self.alive():
            raise BadReply(f"the node died; last pipeline: {_short(pipeline)}")
        with self._connect() as control:
            control.sendall(b"PING\r\n")
            if _read_replies(control, 1) != [b"+PONG\r\n"]:
                raise BadReply("the node does not answer PING")

    def rss(self) -> int:
        with self._connect() as control:
            control.sendall(encode([b"INFO", b"memory"]))
            text = _read_replies(control, 1)[0].decode(errors="replace")
        return int(text.split("used_memory_rss:")[1].split("\r\n")[0])

    def close(self) -> None:
        self._drop()


def _read_replies(sock: socket.socket, count: int) -> list[bytes]:
    """Exactly ``count`` replies, checked; ConnectionError if the node closes first."""
    buf, replies, pos = b"", [], 0
    while len(replies) < count:
        try:
            end = reply_end(buf, pos)
        except Incomplete:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError(f"closed after {len(replies)} of {count} replies") from None
            buf += chunk
            continue
        replies.append(buf[pos:end])
        pos = end
    if pos != len(buf):
        raise BadReply(f"{len(buf) - pos} bytes after the last reply: {buf[pos:pos + 80]!r}")
    return replies


def _short(requests: list[list[bytes]]) -> str:
    return "; ".join(b" ".join(a[:40] + (b"..." if len(a) > 40 else b"") for a in r).decode(errors="replace")
                     for r in requests)[:2000]


def fuzz(session: Session, commands: int, rng_seed: int | None = None, most_per_pipeline: int = 30,
         on_progress=None, seconds: float | None = None) -> None:
    """Sweep every command and subcommand of the table once (``commands`` // 20,000 times
    for a long run), then send random pipelines until ``commands`` requests went out (or,
    after the sweep, ``seconds`` passed).

    Hypothesis runs in rounds, generating only: a live node's state does not replay,
    so nothing is shrunk; the pipeline that failed is in the error.
    """
    deadline = None if seconds is None else time.monotonic() + seconds
    sweeping = True                             # the sweep always runs whole

    def more() -> bool:
        in_time = sweeping or deadline is None or time.monotonic() < deadline
        return session.tally.commands < commands and in_time

    def run_round(strategy, examples: int, round_seed: int | None) -> None:
        @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def one(pipelines):
            for drawn in pipelines:
                if more():
                    session.run(drawn)
                    if on_progress is not None:
                        on_progress(session)
        (one if round_seed is None else seed(round_seed)(one))()

    run_round(sweep(session.token, most_per_pipeline), max(1, commands // 20_000), rng_seed)
    sweeping, rounds = False, 1
    while more():
        run_round(batches(session.token, most_per_pipeline).map(lambda drawn: [drawn]), ROUND,
                  None if rng_seed is None else rng_seed + rounds)
        rounds += 1


def sweep(token: bytes, most: int) -> st.SearchStrategy[list[list[list[bytes]]]]:
    """One request for every command and subcommand of the table, in pipelines of ``most``."""
    def cut(requests: list[list[bytes]]) -> list[list[list[bytes]]]:
        return [requests[i:i + most] for i in range(0, len(requests), most)]
    return st.tuples(*(request(token, entry) for entry in entries())).map(lambda drawn: cut(list(drawn)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--host", default=None, help="fuzz this node instead of starting one")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--dram-size", default="64mb")
    parser.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    opts = parser.parse_args(argv)
    with ProcessGroup() as group:
        if opts.host:
            host, port, alive, log_tail = opts.host, opts.port, (lambda: True), (lambda: "")
        else:
            node = start_kvstore(group, opts.dram_size)
            host, port = HOST, node.port
            alive, log_tail = (lambda: node.process.popen.poll() is None), node.process.log_tail
        return _run(Session(host, port, alive), opts, log_tail)


def _run(session: Session, opts, log_tail) -> int:
    start_rss, warm = session.rss(), {}
    warm_after = opts.commands // 10

    def progress(s: Session) -> None:
        if "rss" not in warm and s.tally.commands >= warm_after:
            warm["rss"] = s.rss()
        if s.tally.pipelines % 500 == 0:
            print(s.tally.line(), flush=True)

    try:
        fuzz(session, opts.commands, opts.seed, on_progress=progress)
    except BadReply as exc:
        print(f"FAILED after {session.tally.line()}:\n{exc}\n--- node log ---\n{log_tail()}", flush=True)
        return 1
    finally:
        session.close()
    end_rss = session.rss()
    growth_mb = (end_rss - warm.get("rss", start_rss)) / 2**20
    print(session.tally.line())
    print(f"node alive; RSS {start_rss / 2**20:.1f} MiB at start, {warm.get('rss', start_rss) / 2**20:.1f} MiB "
          f"after {warm_after} commands, {end_rss / 2**20:.1f} MiB at the end: growth {growth_mb:+.1f} MiB "
          f"(limit {opts.max_rss_growth_mb:.0f})")
    return 0 if growth_mb <= opts.max_rss_growth_mb else 1


if __name__ == "__main__":
    sys.exit(main())
