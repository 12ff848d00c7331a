"""How a node talks to another node: a small pipelined asyncio RESP client.

Why not redis-py: the store depends on no client library (imports point from
clients to the wire protocol, never back), the messages nodes exchange are few
and simple, and values must leave from the arena without a copy: a request's
arguments may be memoryviews of the arena, handed to the socket as they are.
The caller keeps such a view valid (an engine hold) until the call returns.

One `PeerLink` per remote node: one TCP connection, requests pipelined in
order and replies matched in order (RESP has no request ids). Every call has
a timeout. A timeout or a connection error breaks the link: every call in
flight fails with `PeerError` (their replies are lost with the connection)
and the next call connects again, unless a connect failed less than
``RECONNECT_SECONDS`` ago, in which case it fails at once, so a dead peer
costs one connect attempt per interval rather than one per call. An error
reply is a `PeerReplyError` for that call alone; the link stays up.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque

log = logging.getLogger("kvstore.cluster")

CALL_TIMEOUT = 2.0
CONNECT_TIMEOUT = 1.0
RECONNECT_SECONDS = 0.5
MAX_REPLY_BULK = 64 * 1024 * 1024       # a peer's replies are small; a bigger one is a broken peer
MAX_REPLY_ITEMS = 1024 * 1024
INLINE_BELOW = 16 * 1024                # arguments smaller than this are copied into the request header


class PeerError(ConnectionError):
    """The peer could not be reached or did not answer in time."""


class PeerReplyError(Exception):
    """The peer answered with an error reply (the message is its text)."""


def encode(args) -> list:
    """A request as buffers: small arguments gathered, big ones (arena views) passed as they are."""
    head = bytearray(b"*%d\r\n" % len(args))
    parts: list = []
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        size = memoryview(arg).nbytes
        head += b"$%d\r\n" % size
        if size < INLINE_BELOW:
            head += arg
            head += b"\r\n"
        else:
            parts += [bytes(head), arg]
            head = bytearray(b"\r\n")
    parts.append(bytes(head))
    return parts


async def read_reply(reader: asyncio.StreamReader):
    """One RESP2 reply: str for a status, int, bytes or None for a bulk, list, or a PeerReplyError value."""
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode(errors="replace")
    if kind == b"-":
        return PeerReplyError(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        if size > MAX_REPLY_BULK:
            raise PeerError(f"a {size}-byte reply is over the {MAX_REPLY_BULK}-byte limit")
        return (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        count = int(rest)
        if count > MAX_REPLY_ITEMS:
            raise PeerError(f"a {count}-item reply is over the {MAX_REPLY_ITEMS}-item limit")
        return None if count < 0 else [await read_reply(reader) for _ in range(count)]
    raise PeerError(f"unexpected reply {bytes(line[:40])!r}")


class PeerLink:
    """One pipelined connection to the node at ``addr`` (``host:port``)."""

    def __init__(self, addr: str, password: str | None = None, timeout: float = CALL_TIMEOUT,
                 tls_context: ssl.SSLContext | None = None):
        self.addr = addr
        self.password = password
        self.timeout = timeout
        self.tls_context = tls_context      # the cluster speaks TLS (tls-cluster yes)
        host, _, port = addr.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: deque[asyncio.Future] = deque()
        self._connecting = asyncio.Lock()
        self._down_until = 0.0

    async def call(self, *args):
        """Send one command and return its reply; PeerReplyError for an error reply."""
        reply = (await self.pipeline([args]))[0]
        if isinstance(reply, PeerReplyError):
            raise reply
        return reply

    async def pipeline(self, commands: list) -> list:
        """Send ``commands`` back to back; their replies in order (error replies as PeerReplyError values)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                writer = await self._connected()
                futures = []
                for args in commands:
                    future = loop.create_future()
                    self._pending.append(future)
                    futures.append(future)
                    writer.writelines(encode(args))
                await writer.drain()
                return [await future for future in futures]
        except PeerError:
            raise
        except TimeoutError:
            self._break(PeerError(f"node {self.addr} did not answer within {self.timeout:g} s"))
            raise PeerError(f"node {self.addr} did not answer within {self.timeout:g} s") from None
        except OSError as e:
            self._break(PeerError(f"lost node {self.addr}: {e}"))
            raise PeerError(f"lost node {self.addr}: {e}") from None

    async def _connected(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None and not self._writer.is_closing():
                return self._writer
            loop = asyncio.get_running_loop()
            if loop.time() < self._down_until:
                raise PeerError(f"node {self.addr} is unreachable")
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self.tls_context)
                    if self.password:
                        writer.writelines(encode((b"AUTH", self.password)))
                        reply = await read_reply(reader)
                        if isinstance(reply, PeerReplyError):
                            writer.close()
                            raise PeerError(f"node {self.addr} refused AUTH: {reply}")
            except (OSError, TimeoutError) as e:
                self._down_until = loop.time() + RECONNECT_SECONDS
                raise PeerError(f"cannot connect to node {self.addr}: {e or 'timed out'}") from None
            self._writer = writer
            self._reader_task = loop.create_task(self._read_replies(reader, writer))
            return writer

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                reply = await read_reply(reader)
                if not self._pending:
                    raise PeerError(f"node {self.addr} sent a reply nobody asked for")
                future = self._pending.popleft()
                if not future.done():
                    future.set_result(reply)
        except (OSError, asyncio.IncompleteReadError, PeerError, ValueError) as e:
            if self._writer is writer:
                self._break(PeerError(f"lost node {self.addr}: {e or 'connection closed'}"))

    def _break(self, error: PeerError) -> None:
        """Close the connection and fail every call still waiting on it."""
        writer, task = self._writer, self._reader_task
        self._writer = self._reader_task = None
        if writer is not None:
            writer.close()
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self._break(PeerError(f"link to node {self.addr} closed"))


class Peers:
    """The links of one node to the others, made on first use and kept per address."""

    def __init__(self, password: str | None = None, timeout: float = CALL_TIMEOUT,
                 tls_context: ssl.SSLContext | None = None):
        self.password = password
        self.timeout = timeout
        self.tls_context = tls_context
        self._links: dict[str, PeerLink] = {}

    def link(self, addr: str) -> PeerLink:
        link = self._links.get(addr)
        if link is None:
            link = self._links[addr] = PeerLink(addr, self.password, self.timeout, self.tls_context)
        return link

    def keep_only(self, addrs) -> None:
        """Close the links to nodes that left."""
        for addr in list(self._links):
            if addr not in addrs:
                self._links.pop(addr).close()

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
