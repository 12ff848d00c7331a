"""KV-cache commands: KV.PUT, KV.MATCH, KV.LOCATE, KV.STATS.

These speak in block keys (prefix-chained hashes of token blocks). KV.MATCH
answers "how long is the cached prefix of this prompt" in one round trip,
whatever the chain length; KV.PUT records the chain link so eviction can
prefer leaves.
"""
from __future__ import annotations

from kvstore.commands.args import SYNTAX, option_map, parse_int, store
from kvstore.commands.table import CommandError, Family
from kvstore.net.protocol import writer
from proto import wire

FAMILY = Family()

DEFAULT_PIN_TTL_MS = 60_000


@FAMILY.command(wire.KV_PUT, -3, "write denyoom", "kvcache",
         "Stores a KV block, optionally linked to its parent block; NX keeps an existing one; "
         "PIN soft-pins it.", values=lambda i: i == 2)
def kv_put(conn, args):
    opts = option_map(args, 3, {b"PARENT": 1, b"NX": 0, b"PIN": 0})
    if b"NX" in opts and conn.engine.lookup(args[1]) is not None:
        return writer.ZERO
    store(conn, args[1], args[2], opts.get(b"PARENT"))
    if b"PIN" in opts:
        conn.engine.pins.pin(args[1], DEFAULT_PIN_TTL_MS)
    return writer.ONE


@FAMILY.command(wire.KV_PIN, -2, "write fast", "kvcache",
         "Soft-pins a block for ttl-ms (default 60000): evicted last, the pin expires by itself.")
def kv_pin(conn, args):
    if len(args) > 3:
        raise CommandError(SYNTAX)
    ttl = parse_int(args[2]) if len(args) == 3 else DEFAULT_PIN_TTL_MS
    if ttl <= 0:
        raise CommandError("invalid pin time in 'kv.pin' command")
    return writer.integer(int(conn.engine.pins.pin(args[1], ttl)))


@FAMILY.command(wire.KV_UNPIN, 2, "write fast", "kvcache", "Removes a block's soft pin.")
def kv_unpin(conn, args):
    return writer.integer(int(conn.engine.pins.unpin(args[1])))


@FAMILY.command(wire.KV_MATCH, -2, "readonly fast", "kvcache",
         "Returns how many leading keys of a block chain are cached.", keys=(1, -1, 1), spans_slots=True)
def kv_match(conn, args):
    return writer.integer(conn.engine.match_prefix(args[1:]))


@FAMILY.command(wire.KV_LOCATE, -2, "readonly fast", "kvcache",
         "Returns, per key, the tier and size of the block or nil; in a cluster, to a READONLY "
         "connection, also the addresses of the nodes holding copies of it.", keys=(1, -1, 1), spans_slots=True)
def kv_locate(conn, args):
    engine = conn.engine
    cluster = conn.server.cluster
    copies = cluster.copies if cluster is not None and conn.redirects.readonly else None
    items = []
    for key in args[1:]:
        entry = engine.lookup(key)
        if entry is None:
            items.append(conn.enc.null)
            continue
        located = [writer.bulk(engine.tier_of(entry)), writer.integer(engine.size_of(entry))]
        if copies is not None:      # a third element only for readers that can use copies
            located.append(writer.bulk_array(copies.copies_of(key)))
        items.append(writer.array(located))
    return writer.array(items)


@FAMILY.command(wire.KV_STATS, 1, "readonly fast", "kvcache", "Returns hit, miss and per-tier byte counters.",
         keys=(0, 0, 0))
def kv_stats(conn, args):
    return conn.enc.map([(writer.bulk(name), writer.integer(value))
                         for name, value in conn.engine.kv_stats().items()])
