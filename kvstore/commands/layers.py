"""Layer-wise block commands: open a block, write layers, read ranges of layers (waiting if asked).

    KV.BLOCK key header [PARENT p] [TIMEOUT ms] [TOKEN t] -> [offset, n_layers, layer_bytes], or 0 when cached
    KV.PUTLAYER key layer data                    -> layers written so far (the last one commits)
    KV.LAYERDONE token key layer                  -> the same, for a layer the client wrote into the arena
    KV.GETLAYERS key start stop [WAIT ms]         -> [header, bytes of layers start..stop-1] or nil
    KV.LEASELAYERS token ttl key start stop [WAIT ms] -> [lease id, offset, nbytes, header, word, tag] or nil

A stop of -1 means "to the last layer" (a whole tensor value is one layer).

The header (proto/fastpath.py) declares the geometry, so a writer needs no
other metadata and a reader of a finished block needs none at all. With WAIT
a read that finds its layers missing (or the block not yet opened) parks the
client's command stream on the connection (``conn.defer``) until the writer
catches up, the timeout passes (an error), or the block is abandoned (an
error). Without WAIT a missing block is nil and missing layers are an error.

A writer that copies layers into the block's extent through its own mapping
names the arena it mapped, as every fast-path command does: KV.BLOCK with
TOKEN and KV.LAYERDONE answer STALEARENA to a mapping of an arena this node
no longer has (it restarted), so a layer copied into a dead node's memory is
never marked written here.
"""
from __future__ import annotations

from kvstore.commands.args import check_arena_token, option_map, parse_int, parse_ttl_ms
from kvstore.commands.fastpath import refuse_outside_arena
from kvstore.commands.table import CommandError, Family, first_key
from kvstore.local.layers import LayerError, PartialBlock, parse_header
from kvstore.net.protocol import writer
from kvstore.store.arena import Extent
from proto import fastpath as fp

FAMILY = Family()

PENDING = "pending"


def _layer_errors(fn):
    """Turn the block table's LayerError into a command error."""
    def run(*args):
        try:
            return fn(*args)
        except LayerError as exc:
            raise CommandError(str(exc)) from None
    return run


@FAMILY.command(fp.KV_BLOCK, -3, "write denyoom", "layers",
         "Opens a block for layer-wise writing; its header declares dtype, shape and layers.")
@_layer_errors
def kv_block(conn, args):
    opts = option_map(args, 3, {b"PARENT": 1, b"TIMEOUT": 1, b"TOKEN": 1})
    if b"TOKEN" in opts:
        check_arena_token(conn, opts[b"TOKEN"])
    timeout = parse_ttl_ms(opts[b"TIMEOUT"]) if b"TIMEOUT" in opts else fp.PARTIAL_TIMEOUT_MS
    block = conn.server.blocks.open(args[1], args[2], opts.get(b"PARENT"), timeout)
    if block is None:
        return writer.ZERO
    g = block.geometry
    return writer.array([writer.integer(block.extent.offset), writer.integer(g.n_layers),
                         writer.integer(g.layer_bytes)])


def _layer_index(arg: bytes) -> int:
    return parse_int(arg, "layer index must be an integer")


@FAMILY.command(fp.KV_PUTLAYER, 4, "write denyoom", "layers", "Writes one layer of an open block.",
         values=lambda i: i == 3)
@_layer_errors
def kv_putlayer(conn, args):
    data = args[3].view if isinstance(args[3], Extent) else args[3]
    return writer.integer(conn.server.blocks.write(args[1], _layer_index(args[2]), data))


@FAMILY.command(fp.KV_LAYERDONE, 4, "write fast", "layers",
         "Marks a layer the client wrote straight into the block's extent as complete.", keys=(2, 2, 1))
@_layer_errors
def kv_layerdone(conn, args):
    check_arena_token(conn, args[1])
    return writer.integer(conn.server.blocks.mark(args[2], _layer_index(args[3])))


# ------------------------------------------------------------------ reads

def _find(conn, key: bytes, start: int, stop: int):
    """The partial block holding the range, the engine entry of the finished block,
    PENDING when the block is open but the range is not in yet, or None."""
    block = conn.server.blocks.blocks.get(key)
    if block is not None:
        return block if block.has(*block.geometry.resolve(start, stop)) else PENDING
    return conn.engine.lookup(key)


def _read_layers(conn, args: list, first: int, reply) -> bytes | None:
    """Parse ``key start stop [WAIT ms]`` at ``first``; reply now or when the layers are in."""
    key = args[first]
    start, stop = _layer_index(args[first + 1]), _layer_index(args[first + 2])
    opts = option_map(args, first + 3, {b"WAIT": 1})
    found = _find(conn, key, start, stop)
    if b"WAIT" not in opts or (found is not None and found != PENDING):
        if found == PENDING:
            raise CommandError(f"layers [{start}, {stop}) of the block are not written yet")
        return reply(found, start, stop)
    timeout_s = parse_ttl_ms(opts[b"WAIT"]) / 1000
    seen = [found == PENDING]

    def ready() -> bool:
        now = _find(conn, key, start, stop)
        seen[0] = seen[0] or now == PENDING
        return now not in (None, PENDING) or (now is None and seen[0])

    def resume(arrived: bool) -> None:
        try:
            now = _find(conn, key, start, stop)
            if not arrived:
                raise CommandError(f"timed out waiting for layers [{start}, {stop}) of the block")
            if now is None and seen[0]:
                raise CommandError("the block was abandoned by its writer before these layers were written")
            conn.write(reply(now, start, stop))
        except (CommandError, LayerError) as exc:
            conn.write(writer.error(str(exc), getattr(exc, "code", "ERR")))

    conn.defer(conn.server.blocks.wait(key, ready, timeout_s), resume)
    return None


def _source(conn, found, start: int, stop: int) -> tuple[memoryview, memoryview, int]:
    """(header, the bytes of layers start..stop-1, their offset within the value)."""
    value = found.extent.view if isinstance(found, PartialBlock) else conn.engine.view(found)
    header = value[:fp.HEADER_SIZE]
    geometry = parse_header(header)
    start, stop = geometry.resolve(start, stop)
    first, last = geometry.slot_offset(start), geometry.slot_offset(stop)
    return header, value[first:last], first


@FAMILY.command(fp.KV_GETLAYERS, -4, "readonly", "layers",
         "Returns the header and a range of layers of a block; WAIT ms waits for them.",
         reads=first_key)
@_layer_errors
def kv_getlayers(conn, args):
    def reply(found, start, stop):
        if found is None:
            return conn.enc.null
        header, data, _ = _source(conn, found, start, stop)
        return writer.array([writer.bulk(bytes(header)), writer.bulk_header(len(data)) + data + writer.CRLF])
    return _read_layers(conn, args, 1, reply)


@FAMILY.command(fp.KV_LEASELAYERS, -6, "readonly", "layers",
         "Leases a range of layers for a direct read: [lease id, offset, nbytes, header, word, tag]; "
         "WAIT ms waits.",
         keys=(3, 3, 1), reads=lambda conn, args: [args[3]])
@_layer_errors
def kv_leaselayers(conn, args):
    check_arena_token(conn, args[1])
    ttl = parse_ttl_ms(args[2])

    def reply(found, start, stop):
        if found is None:
            return conn.enc.null
        header, data, first = _source(conn, found, start, stop)
        engine = conn.engine
        if isinstance(found, PartialBlock):
            base, unpin, entry = found.extent.offset, conn.server.blocks.pin(found), None
        else:
            key, entry = engine.key_of(found), found
            engine.get_entry(key)
            base = engine.holds.hold(found)   # the token is the value's arena offset
            if base is None:
                refuse_outside_arena(conn.server.leases, [])
            unpin = lambda: engine.holds.release(base)    # noqa: E731
        lease = conn.server.leases.grant(conn, len(data), ttl, unpin, entry=entry)
        return writer.array([writer.integer(lease.id), writer.integer(base + first), writer.integer(len(data)),
                             writer.bulk(bytes(header)), writer.integer(lease.word), writer.integer(lease.tag)])
    return _read_layers(conn, args, 3, reply)
