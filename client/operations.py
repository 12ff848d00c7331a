"""What each SDK method sends, and how its replies become the method's result.

Every public method of `KVClient` and `AsyncKVClient` (but the tensor and
layer methods: `layers`) is a one-line call into this module, which returns
a `Call`: the commands of one round trip (a batch is one pipelined round
trip), the sink for each reply (where a bulk value is received), whether the
call may be retried on a new connection, and the function that turns the
replies into the result. The clients hand Calls to a transport, blocking or
asyncio, which runs them through the sans-I/O `core`, so the command logic
exists once for both.

A Call for a get or a put also describes itself as a `LocalRead` or
`LocalWrite`, so the local fast path (`arena_reads`, `arena_writes`) can move
the same bytes through the node's arena instead and still finish with the
same function: its results have the shapes the wire replies have.

Retrying is safe for reads and for overwriting puts. A put-once (`NX`) put
and DEL are not retried once sent: had the first attempt landed, the retry
would report "existed" or "0 deleted" for work that the first attempt did.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from client import resp
from client.buffers import Key, readable_view, writable_view
from client.errors import BufferTooSmall, KVError, ProtocolError
from client.hashing import BlockHasher
from client.steps import RoundTrip, Steps
from proto import wire

Value = Any        # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol
Items = Mapping[Key, Value] | Iterable[tuple[Key, Value]]


@dataclass(frozen=True)
class Location:
    """Where a cached block lives: its tier ("gpu", "dram" or "ssd"), its size in bytes, and
    (in a cluster) the nodes holding copies of it, as "host:port"."""

    tier: str
    size: int
    copies: tuple[str, ...] = ()


@dataclass
class LocalRead:
    """Values to read: into the caller's views, or into fresh bytearrays where a view is None."""

    keys: list[Key]
    views: list[memoryview | None]


@dataclass
class LocalWrite:
    """Values to store, as byte views, with their parent links and the put-once choice; ``trailing``
    requests ride after the publish in the same round trip (their replies are not the put's)."""

    keys: list[Key]
    views: list[memoryview]
    parents: list[Key | None]
    overwrite: bool
    trailing: list[tuple] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)


@dataclass
class Call:
    """One round trip: pipelined requests, a sink per reply, and how replies become the result."""

    requests: list[tuple]
    finish: Callable[[list[Any]], Any]
    sinks: list[resp.Sink] | None = None
    idempotent: bool = True
    local: LocalRead | LocalWrite | None = None

    def over_wire(self, core) -> Steps:
        """The round trip on a pooled connection (none at all for an empty batch)."""
        if not self.requests:
            return self.finish([])
        return (yield from core.on_connection(self._exchange, self.idempotent))

    def _exchange(self, conn) -> Steps:
        return self.finish((yield RoundTrip(self.requests, self.sinks)))


def put(key: Key, value: Value, parent: Key | None, overwrite: bool) -> Call:
    return Call([_put_args(key, value, parent, overwrite)], lambda replies: bool(_only(replies)),
                idempotent=overwrite, local=LocalWrite([key], [readable_view(value)], [parent], overwrite))


def batch_put(items: Items, parents: Sequence[Key | None] | None, overwrite: bool,
              chain_links: Sequence[tuple[Key, Key]] = ()) -> Call:
    """Puts in one round trip; ``chain_links`` (parent, child) pairs ride after them as KV.LINK, their
    replies ignored (a cluster node's hint for its eviction cascade, never worth failing a put)."""
    pairs, links = with_parents(items, parents)
    puts = [_put_args(k, v, p, overwrite) for (k, v), p in zip(pairs, links)]
    trailing = [(wire.KV_LINK, *(key for link in chain_links[i:i + wire.KV_LINK_MAX] for key in link))
                for i in range(0, len(chain_links), wire.KV_LINK_MAX)]
    local = LocalWrite([k for k, _ in pairs], [readable_view(v) for _, v in pairs], links, overwrite, trailing)
    return Call([*puts, *trailing], lambda replies: [bool(r) for r in _checked(replies[:len(puts)])],
                idempotent=overwrite, local=local)


def get(key: Key) -> Call:
    return Call([("GET", key)], _only, local=LocalRead([key], [None]))


def batch_get(keys: Sequence[Key]) -> Call:
    return Call([("GET", k) for k in keys], _checked, local=LocalRead(list(keys), [None] * len(keys)))


def get_into(key: Key, buffer: Any) -> Call:
    return batch_get_into([key], [buffer], finish=_only)


def batch_get_into(keys: Sequence[Key], buffers: Sequence[Any],
                   finish: Callable[[list[Any]], Any] | None = None) -> Call:
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
    views = [writable_view(b) for b in buffers]
    sinks = [_into(k, v) for k, v in zip(keys, views)]
    return Call([("GET", k) for k in keys], finish or _checked, sinks, local=LocalRead(list(keys), views))


def exists(keys: Sequence[Key]) -> Call:
    return _counting("EXISTS", keys, idempotent=True)


def delete(keys: Sequence[Key]) -> Call:
    return _counting("DEL", keys, idempotent=False)


def match_prefix(keys: Sequence[Key]) -> Call:
    return _counting(wire.KV_MATCH, keys, idempotent=True)


def match_tokens(hasher: BlockHasher, token_ids: Any) -> Call:
    keys = hasher.keys(token_ids)
    if not keys:
        return Call([], lambda replies: 0)
    return Call([(wire.KV_MATCH, *keys)], lambda replies: _only(replies) * hasher.block_tokens)


def locate(keys: Sequence[Key]) -> Call:
    if not keys:
        return Call([], lambda replies: [])
    return Call([(wire.KV_LOCATE, *keys)], lambda replies: [_location(e) for e in _only(replies)])


def stats() -> Call:
    return Call([(wire.KV_STATS,)], lambda replies: _stats(_only(replies)))


def ping() -> Call:
    return Call([("PING",)], lambda replies: _only(replies) == "PONG")


def execute(args: Sequence[Any]) -> Call:
    """Any command, its reply returned as parsed (errors raised)."""
    return Call([tuple(args)], _only, idempotent=False)


def with_parents(items: Items, parents: Sequence[Key | None] | None) -> tuple[list[tuple[Key, Any]], list]:
    """A batch's (key, value) pairs and one parent key (or None) for each."""
    pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
    links = [None] * len(pairs) if parents is None else list(parents)
    if len(links) != len(pairs):
        raise ValueError(f"{len(pairs)} items but {len(links)} parents")
    return pairs, links


def put_options(parent: Key | None, overwrite: bool) -> tuple:
    """The options of a put (KV.PUT, KV.PUBLISH): its parent link and put-once."""
    return (*(("PARENT", parent) if parent is not None else ()), *(() if overwrite else ("NX",)))


def _put_args(key: Key, value: Value, parent: Key | None, overwrite: bool) -> tuple:
    return (wire.KV_PUT, key, value, *put_options(parent, overwrite))


def _counting(command: str, keys: Sequence[Key], idempotent: bool) -> Call:
    if not keys:
        return Call([], lambda replies: 0)
    return Call([(command, *keys)], _only, idempotent=idempotent)


def _into(key: Key, view: memoryview) -> resp.Sink:
    return resp.into(view, lambda size: BufferTooSmall(key, size, view.nbytes))


def _checked(replies: list[Any]) -> list[Any]:
    """The replies, after raising the first error among them."""
    for reply in replies:
        if isinstance(reply, KVError):
            raise reply
    return replies


def _only(replies: list[Any]) -> Any:
    return _checked(replies)[0]


def _location(entry: Any) -> Location | None:
    if entry is None:
        return None
    try:
        tier, size, *more = entry
        copies = tuple(bytes(addr).decode() for addr in more[0]) if more else ()
        return Location(bytes(tier).decode(), int(size), copies)
    except (TypeError, ValueError, IndexError):
        raise ProtocolError(f"unexpected KV.LOCATE entry {entry!r}") from None


def _stats(reply: Any) -> dict[str, int]:
    if not isinstance(reply, list) or len(reply) % 2:
        raise ProtocolError(f"unexpected KV.STATS reply {reply!r}")
    return {bytes(name).decode(): value for name, value in zip(reply[::2], reply[1::2])}

